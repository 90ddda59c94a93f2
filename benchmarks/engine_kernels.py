"""specla's verify + commit on a serving engine's data against the engines' own published
Triton kernels, side by side in one process, for GDN, Mamba2 and KDA layers (issue 44;
../shared/docs/ENGINES.md).

    python benchmarks/engine_kernels.py --extract .engines          # with network: the kernel files
    python benchmarks/engine_kernels.py --kernels .engines --out engine.json [--tp 4] [--ops kda]
    TRITON_INTERPRET=1 python benchmarks/engine_kernels.py --device cpu --preset tiny --out tiny.json

The engines' kernel files (SGLang 0.5.23, vLLM 0.34.0: :mod:`specla.testing.engine_kernels`) are
read from ``--kernels DIR`` (a folder ``--extract DIR`` wrote) or from the per-user cache, which
downloads them. ``--ops`` picks the ops (``gdn``, ``mamba2``, ``kda``; default all) and so the
preset's models of them (:data:`MODELS`: published shapes). One cell is one layer of one op of
one rank (heads, and Mamba2's groups, split by tensor parallelism ``--tp``) at one batch and one
draft shape; every call is one layer:
- ``treeD``: trees of ``D`` nodes (root included), each row its own, grown best-first with up to
  4 children a node (``kernels.pruned_tree``, seeded); each row accepts the root path of a
  random node. specla (``{gdn,kda,mamba2}_pool_verify`` + ``_pool_commit``) against SGLang's tree
  verify (GDN and KDA: ``fused_sigmoid_gating_delta_rule_update``, ``is_kda`` for KDA; Mamba2:
  ``selective_state_update``) with ``retrieve_parent_token`` and one fp32 state per node in
  ``intermediate_states_buffer``, + the accepted node's state scattered into the pool.
- ``chainT``: chains of ``T`` tokens, each row accepting a random prefix. specla, SGLang's
  per-node snapshots as above, for GDN and KDA SGLang's ReplaySSM (verify writing the raw k, v
  (activation dtype), gate and beta (fp32; KDA's gate a key channel) into per-slot rings, then
  its fold replaying the accepted prefix into the pool), and vLLM's chain kernel (GDN:
  ``fused_sigmoid_gating_delta_rule_update``; KDA: ``fused_recurrent_kda``; Mamba2:
  ``selective_state_update`` at its default launch heuristic; one state slot per position,
  ``[N, T]`` slot indices; it commits by reading the last accepted position's slot at the next
  step, no copy), and for GDN ``vllm_fused_mtp``: ``fused_gdn_decode_post_conv_mtp_triton``,
  vLLM's ROCm Triton port of the compiled CUDA op its GDN layer runs by default on NVIDIA for
  chains of up to 9 tokens, a stand-in for that op, not the CUDA kernel itself (the same slots;
  timed without its fused output norm's launch, :func:`vllm_fused_mtp`).
The state pool has ``2 N + 1`` fp32 slots (vLLM's ``2 N T + 1``, slot 0 its null block) of GDN's
and KDA's ``[HV, V, K]``, Mamba2's ``[H, P, NS]``, the rows' slots picked at random. GDN, KDA: q,
k, v strided views of one projection, a and b raw gate inputs, all in ``--dtype``; ``A_log``,
``dt_bias`` fp32; q, k l2-normed in the kernels. Mamba2: x, B, C strided views of one conv
output, dt a slice of a projection, in ``--dtype``; ``A``, ``dt_bias``, ``D`` fp32 expanded over
the head dim as the engines pass them (:func:`mamba2_layer`).

Before timing, every contender runs once on the cell's inputs from its own copy of the pool, and
its outputs and committed states are compared with SGLang's per-node snapshots (the engine's
own): max abs errors recorded; a cell agrees when every output is within ``2^-7 |ref| + 1e-4
max|ref|`` (one bf16 rounding) and every committed state within ``1e-4 max|ref|``. A cell that
does not agree is timed and marked. Times: on CUDA, each contender's calls over rotating input
sets (``kernels.copies_for``) are captured in one CUDA graph; the graphs are replayed in turn
(interleaved), ``--reps`` times after 3 untimed rounds: the median device µs per call. On the CPU
(Triton's interpreter) the median wall µs of direct calls, which says nothing about a GPU.

Memory per running request and layer, from the buffers each contender allocated: its pool
slot(s) plus its speculation buffers (SGLang: ``D`` states; specla: its factor records; ReplaySSM:
its rings; both vLLM contenders: ``T`` slots in all); times the model's layers of the op, and how
many running requests fit in ``--budget-gib`` on one rank. Writes ``--out`` (JSON: ``meta``
provenance, ``cells``, ``memory``, ``complete``) and the same path with ``.md`` (tables), printed
last; both are rewritten after every cell, so a run cut short keeps what it timed (``complete``:
false).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

from kernels import copies_for, pruned_tree  # this folder is on sys.path when the script runs
from provenance import add_allow_dirty, provenance
from specla.mixers.gdn import serving as gdn_serving
from specla.mixers.gdn import verify as gdn_verify
from specla.mixers.kda import serving as kda_serving
from specla.mixers.mamba2 import serving as mamba2_serving
from specla.mixers.kda import verify as kda_verify
from specla.mixers.mamba2 import verify as mamba2_verify
from specla.testing import engine_kernels

# shapes of the whole model's linear-attention layers (op, dims, layers of that op), as published:
# GDN key heads H, value heads HV, head dims K, V; Mamba2 heads H of dim P, NG groups of state NS;
# KDA heads H of dims K, V
MODELS = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, every fourth full attention;
    # linear_num_{key,value}_heads 16, 32, linear_{key,value}_head_dim 128
    "qwen3-next-80b-a3b": dict(op="gdn", H=16, HV=32, K=128, V=128, layers=36),
    # 40 layers, linear attention 3 of every 4 (THUDM/slime scripts/models/qwen3.5-35B-A3B.sh)
    "qwen3.5-35b-a3b": dict(op="gdn", H=16, HV=32, K=128, V=128, layers=30),
    # nvidia/Nemotron-H-8B-Base-8K: mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128,
    # n_groups 8; 24 of its 52 layers Mamba2
    "nemotron-h-8b": dict(op="mamba2", H=128, P=64, NG=8, NS=128, layers=24),
    # nvidia/Nemotron-H-56B-Base-8K: mamba_num_heads 256, mamba_head_dim 64, ssm_state_size 256,
    # n_groups 8; 54 of its 118 layers Mamba2 (arXiv 2504.03624)
    "nemotron-h-56b": dict(op="mamba2", H=256, P=64, NG=8, NS=256, layers=54),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json linear_attn_config: num_heads 32,
    # head_dim 128; kda_layers 20 of its 27 layers
    "kimi-linear-48b-a3b": dict(op="kda", H=32, K=128, V=128, layers=20),
    "tiny": dict(op="gdn", H=2, HV=4, K=16, V=64, layers=2),  # V: the least vllm_fused_mtp takes
    "tiny-mamba2": dict(op="mamba2", H=4, P=16, NG=2, NS=16, layers=2),
    "tiny-kda": dict(op="kda", H=2, K=16, V=16, layers=2),
}
PRESETS = {
    "full": dict(models="qwen3-next-80b-a3b,qwen3.5-35b-a3b,nemotron-h-8b,nemotron-h-56b,kimi-linear-48b-a3b",
                 tp="2,4,8", batches="1,8,32,64,128,256", trees="8,16,32,64", chains="4,8", dtype="bfloat16"),
    "tiny": dict(models="tiny,tiny-mamba2,tiny-kda", tp="1", batches="1,3", trees="6", chains="3", dtype="float32"),
}
REFERENCE = "sglang"


class Contender(NamedTuple):
    run: Callable[[], torch.Tensor]  # one layer's verify + commit; returns the outputs, SGLang's layout
    committed: Callable[[], torch.Tensor]  # [N, *state] the rows' committed states
    slot_bytes: int  # pool bytes a running request holds (one layer)
    spec_bytes: int  # speculation buffers a running request holds (one layer)


def gdn_layer(x, T, rnd, gen, dev, dtype) -> tuple[dict, torch.Tensor]:
    """GDN (``gate`` HV: one gate a value head) or KDA (``gate`` H K: one a key channel) verify
    inputs of ``T`` tokens as SGLang hands them over, and a pool ``[slots, HV, V, K]``."""
    HV = x.HV if x.op == "gdn" else x.H
    gate = HV if x.op == "gdn" else x.H * x.K
    q, k, v = torch.split(rnd(T, 2 * x.H * x.K + HV * x.V, dt=dtype), [x.H * x.K, x.H * x.K, HV * x.V], dim=-1)
    layer = dict(q=q.view(1, T, x.H, x.K), k=k.view(1, T, x.H, x.K), v=v.view(1, T, HV, x.V), a=rnd(T, gate, dt=dtype),
                 b=rnd(T, HV, dt=dtype), A_log=torch.rand(HV, generator=gen, device=dev) * 2 - 1,
                 dt_bias=rnd(gate) * 0.5)
    return layer, rnd(x.slots, HV, x.V, x.K) * 0.3


def mamba2_layer(x, T, rnd, gen, dev, dtype) -> tuple[dict, torch.Tensor]:
    """Mamba2 verify inputs as both engines pass them: ``x``, ``B``, ``C`` strided views of one
    conv output and ``dt`` of the projection, ``[N, D, ...]`` (SGLang's; vLLM's is the same
    memory as ``[Ttot, ...]``), ``dt``, ``A``, ``dt_bias``, ``D`` expanded over ``P`` (and ``A``
    over ``NS``, stride 0); Mamba2's initialisation (``softplus(dt_bias)`` log-uniform in
    [1e-3, 0.1], ``A = -[1, 16]``); and a pool ``[slots, H, P, NS]``."""
    H, P, NG, NS, lead = x.H, x.P, x.NG, x.NS, (x.N, x.D)
    xs, B, C = torch.split(rnd(T, H * P + 2 * NG * NS, dt=dtype), [H * P, NG * NS, NG * NS], dim=-1)
    dt = rnd(T, H + 3, dt=dtype)[:, :H]  # a slice of a wider projection
    dt0 = 1e-3 * 100 ** torch.rand(H, generator=gen, device=dev)
    layer = dict(x=xs.view(*lead, H, P), B=B.view(*lead, NG, NS), C=C.view(*lead, NG, NS),
                 dt=dt.view(*lead, H, 1).expand(*lead, H, P),
                 A=(-(16 ** torch.rand(H, generator=gen, device=dev)))[:, None, None].expand(H, P, NS),
                 dt_bias=torch.log(torch.expm1(dt0))[:, None].expand(H, P), D=rnd(H)[:, None].expand(H, P))
    return layer, rnd(x.slots, H, P, NS) * 0.3


def cell_inputs(op, shape: dict, N, D, tree: bool, dtype, dev, seed: int) -> SimpleNamespace:
    """One layer's verify inputs for ``N`` rows of ``D`` tokens, the pool, and the acceptance."""
    rng, gen = random.Random(seed), torch.Generator(dev).manual_seed(seed)
    rnd = lambda *s, dt=torch.float32: torch.randn(*s, generator=gen, device=dev).to(dt)  # noqa: E731
    x = SimpleNamespace(op=op, N=N, D=D, slots=2 * N + 1, **shape)
    x.layer, x.pool = OPS[op].layer(x, N * D, rnd, gen, dev, dtype)
    trees = [pruned_tree(D, 4, min(D - 1, 8), rng) if tree else list(range(-1, D - 1)) for _ in range(N)]
    paths = []
    for par in trees:
        path = [rng.randrange(D)]
        while path[-1] > 0:
            path.append(par[path[-1]])
        paths.append(path[::-1])
    accept_index = torch.full((N, D), -1, dtype=torch.int64)
    for n, p in enumerate(paths):
        accept_index[n, : len(p)] = torch.tensor(p) + n * D
    i32 = dict(dtype=torch.int32, device=dev)
    x.slot = torch.randperm(x.slots, generator=gen, device=dev)[:N].to(torch.int32)
    x.rows = torch.randperm(N, generator=gen, device=dev).to(torch.int32)
    x.qsl = torch.arange(0, N * D + 1, D, **i32)
    x.parents = torch.tensor(trees, device=dev) if tree else None
    x.accept_index, x.accept_lens = accept_index.to(dev), torch.tensor([len(p) for p in paths], **i32)
    x.last = torch.tensor([p[-1] for p in paths], device=dev)
    x.prev_accepted = torch.tensor([rng.randint(1, D) for _ in range(N)], **i32)
    return x


SG_CALL = dict(softplus_beta=1.0, softplus_threshold=20.0, use_qk_l2norm_in_kernel=True)


def specla(x, _) -> Contender:
    """``*_pool_verify`` + ``*_pool_commit`` of :mod:`specla.mixers.{gdn,kda,mamba2}.serving`."""
    pool = x.pool.clone()
    if x.op == "mamba2":
        rec = mamba2_serving.empty_record_buffers(x.N, x.D, x.H, x.P, x.NG, x.NS, pool.device)

        def run():
            o = mamba2_serving.mamba2_pool_verify(
                pool, dt_softplus=True, state_batch_indices=x.slot, records=rec, intermediate_state_indices=x.rows,
                cache_steps=x.D, retrieve_parent_token=x.parents, **x.layer)
            mamba2_serving.mamba2_pool_commit(pool, x.slot, rec, x.rows, x.accept_index, x.accept_lens, x.D)
            return o
    else:
        serving = gdn_serving if x.op == "gdn" else kda_serving
        heads = (x.H, x.HV) if x.op == "gdn" else (x.H,)
        rec = serving.empty_record_buffers(x.N, x.D, *heads, x.K, x.V, pool.device)
        verify, commit = (gdn_serving.gdn_pool_verify, gdn_serving.gdn_pool_commit) if x.op == "gdn" else \
            (kda_serving.kda_pool_verify, kda_serving.kda_pool_commit)

        def run():
            o = verify(**SG_CALL, initial_state_source=pool, initial_state_indices=x.slot, cu_seqlens=x.qsl,
                       records=rec, intermediate_state_indices=x.rows, cache_steps=x.D,
                       retrieve_parent_token=x.parents, **x.layer)
            commit(pool, x.slot, rec, x.rows, x.accept_index, x.accept_lens, x.D)
            return o
    return Contender(run, lambda: pool[x.slot.long()], pool[0].nbytes, sum(r.nbytes for r in rec) // x.N)


def sglang(x, eng) -> Contender:
    """SGLang's verify with one fp32 state per node in its intermediate buffer (trees through
    ``retrieve_parent_token``), then the accepted node's state scattered into the slot."""
    pool = x.pool.clone()
    scratch = torch.empty(x.N, x.D, *pool.shape[1:], device=pool.device)  # MambaPool's intermediate buffer
    slot, rows = x.slot.long(), x.rows.long()
    snapshots = dict(disable_state_update=True, intermediate_states_buffer=scratch, intermediate_state_indices=x.rows,
                     cache_steps=x.D, retrieve_parent_token=x.parents)
    out = torch.empty_like(x.layer["x"]) if x.op == "mamba2" else None

    def run():
        if x.op == "mamba2":
            eng.sglang.mamba.selective_state_update(pool, z=None, dt_softplus=True, state_batch_indices=x.slot,
                                                    out=out, **snapshots, **x.layer)
            o = out
        else:
            o = eng.sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
                **SG_CALL, initial_state_source=pool, initial_state_indices=x.slot, cu_seqlens=x.qsl,
                is_kda=x.op == "kda", **snapshots, **x.layer)
        pool[slot] = scratch[rows, x.last]  # the accepted node's snapshot into the request's slot
        return o
    return Contender(run, lambda: pool[slot], pool[0].nbytes, scratch.nbytes // x.N)


def sglang_replayssm(x, eng) -> Contender:
    """SGLang's ReplaySSM (GDN, KDA): the verify writes raw k, v (activation dtype), gate (one a
    value head, or a key channel for KDA) and beta (fp32) into per-slot rings; its fold replays
    the accepted prefix into the pool."""
    pool = x.pool.clone()
    (S, HV, V, K), dt, dev = pool.shape, x.layer["v"].dtype, pool.device
    gate = () if x.op == "gdn" else (K,)
    ring = dict(replayssm_rawv=torch.empty(S, HV, x.D, V, dtype=dt, device=dev),
                replayssm_rawk=torch.empty(S, x.H, x.D, K, dtype=dt, device=dev),
                replayssm_g=torch.empty(S, HV, x.D, *gate, device=dev),
                replayssm_beta=torch.empty(S, HV, x.D, device=dev))
    rings = [ring[f"replayssm_{n}"] for n in ("rawv", "rawk", "g", "beta")]
    if x.op == "gdn":
        fold = lambda: eng.sglang.fold.commit_gdn_replayssm_fold_all_layers(  # noqa: E731
            pool[None], *(r[None] for r in rings), x.slot, x.accept_lens, max_cache_len=x.D, num_k_heads=x.H)
    else:  # SGLang's commit after verify passes null_block_id -1: slot 0 is a request's
        fold = lambda: eng.sglang.kda_fold.commit_kda_replayssm_spec(  # noqa: E731
            pool, *rings, x.slot, x.accept_lens, max_cache_len=x.D, num_k_heads=x.H, null_block_id=-1)

    def run():
        o = eng.sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
            **SG_CALL, initial_state_source=pool, initial_state_indices=x.slot, cu_seqlens=x.qsl,
            is_kda=x.op == "kda", disable_state_update=True, cache_ring=True, **ring, **x.layer)
        fold()
        return o
    return Contender(run, lambda: pool[x.slot.long()], pool[0].nbytes, sum(r.nbytes for r in rings) // S)


def vllm_slots(x) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's slots of the rows' positions, ``[N, T]`` int32 (distinct, random), and its pool of
    ``2 N T + 1`` fp32 slots (slot 0 its null block) where each row's start state is in the slot
    of its previous step's last accepted position (``x.prev_accepted``)."""
    N, D, dev = x.N, x.D, x.pool.device
    gen = torch.Generator(dev).manual_seed(N * D)
    vslots = (1 + torch.randperm(2 * N * D, generator=gen, device=dev)[: N * D]).view(N, D).to(torch.int32)
    vpool = torch.empty(1 + 2 * N * D, *x.pool.shape[1:], device=dev)
    vpool[vslots[torch.arange(N, device=dev), x.prev_accepted.long() - 1].long()] = x.pool[x.slot.long()]
    return vslots, vpool


def vllm_contender(x, vslots, vpool, run) -> Contender:
    """A vLLM chain contender: it commits by reading the last accepted position's slot at the next
    step, no copy; a running request holds ``T`` slots."""
    rows = torch.arange(x.N, device=vpool.device)
    return Contender(run, lambda: vpool[vslots[rows, x.accept_lens.long() - 1].long()], vpool[0].nbytes,
                     (vslots.shape[1] - 1) * vpool[0].nbytes)


def vllm(x, eng) -> Contender:
    """vLLM's chain kernel: one state slot per position (``[N, T]`` slot indices, :func:`vllm_slots`)."""
    vslots, vpool = vllm_slots(x)
    chain = dict(cu_seqlens=x.qsl, num_accepted_tokens=x.prev_accepted)
    if x.op == "mamba2":
        flat = {k: t.flatten(0, 1) if k in ("x", "dt", "B", "C") else t for k, t in x.layer.items()}
        out = torch.empty_like(flat["x"])

        def run():
            eng.vllm_mamba2.selective_state_update(vpool, dt_softplus=True, state_batch_indices=vslots,
                                                   dst_state_batch_indices=vslots, out=out, **chain, **flat)
            return out.view_as(x.layer["x"])
    elif x.op == "kda":
        L, T = x.layer, x.N * x.D

        def run():
            return eng.vllm_kda.fused_recurrent_kda(
                q=L["q"], k=L["k"], v=L["v"], raw_g=L["a"].view(1, T, x.H, x.K), raw_beta=L["b"].view(1, T, x.H),
                A_log=L["A_log"], dt_bias=L["dt_bias"], lower_bound=None, initial_state=vpool,
                ssm_state_indices=vslots, **chain)[0]
    else:
        def run():
            return eng.vllm.fused_sigmoid_gating_delta_rule_update(
                initial_state=vpool, inplace_final_state=True, ssm_state_indices=vslots, use_qk_l2norm_in_kernel=True,
                **chain, **x.layer)[0]
    return vllm_contender(x, vslots, vpool, run)


def vllm_fused_mtp(x, eng) -> Contender:
    """GDN chains through ``fused_gdn_decode_post_conv_mtp_triton``: vLLM's ROCm Triton port of
    the compiled CUDA op (``fused_gdn_decode_post_conv_mtp``, in vLLM's ``_C`` extension) that
    its GDN layer runs by default on NVIDIA for chains of up to 9 tokens. A stand-in for that
    op, not the CUDA kernel itself. The same slots as :func:`vllm`; q, k, v read from their
    projection, the raw gates from theirs. Timed without its second launch, the output's gated
    RMSNorm (which the other contenders leave to the layer); its update still writes the sums of
    squares that norm reads. Needs a power-of-2 ``V`` of at least 64; chains longer than 9
    tokens time the port where vLLM would not take it."""
    vslots, vpool = vllm_slots(x)
    L, T = x.layer, x.N * x.D
    q, (HV, V) = L["q"], L["v"].shape[-2:]
    mixed_qkv = q.as_strided((T, q.stride(1)), (q.stride(1), 1))  # the projection q, k, v are views of
    out = torch.empty(T, HV, V, dtype=q.dtype, device=q.device)
    # the skipped norm's arguments, which the op checks
    norm = dict(output_gate=torch.empty_like(out), norm_weight=out.new_ones(V), norm_eps=1e-6,
                output_gate_activation="silu")

    def run():
        eng.vllm_mtp.fused_gdn_decode_post_conv_mtp_triton(
            mixed_qkv=mixed_qkv, a=L["a"], b=L["b"], A_log=L["A_log"], dt_bias=L["dt_bias"], state_indices=vslots,
            cu_seqlens=x.qsl, num_accepted_tokens=x.prev_accepted, state=vpool, out=out, scale=x.K**-0.5, **norm)
        return out.view_as(L["v"])
    return vllm_contender(x, vslots, vpool, run)


class Op(NamedTuple):
    dims: tuple[str, ...]  # a model's shape fields (MODELS), in order
    split: tuple[str, ...]  # those that tensor parallelism divides
    layer: Callable  # (inputs, tokens, rnd, gen, dev, dtype) -> (layer kwargs, pool)
    contenders: dict[str, dict[str, Callable]]  # per workload kind


OPS = {
    "gdn": Op(("H", "HV", "K", "V"), ("H", "HV"), gdn_layer, {
        "tree": {"specla": specla, "sglang": sglang},
        "chain": {"specla": specla, "sglang": sglang, "sglang_replayssm": sglang_replayssm, "vllm": vllm,
                  "vllm_fused_mtp": vllm_fused_mtp}}),
    "mamba2": Op(("H", "P", "NG", "NS"), ("H", "NG"), mamba2_layer, {
        "tree": {"specla": specla, "sglang": sglang},
        "chain": {"specla": specla, "sglang": sglang, "vllm": vllm}}),
    "kda": Op(("H", "K", "V"), ("H",), gdn_layer, {
        "tree": {"specla": specla, "sglang": sglang},
        "chain": {"specla": specla, "sglang": sglang, "sglang_replayssm": sglang_replayssm, "vllm": vllm}}),
}
NAMES = ["specla", "sglang", "sglang_replayssm", "vllm", "vllm_fused_mtp"]  # every op's contenders, in table order


def check(outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, bool]:
    """Max abs errors of every contender's output and committed states against :data:`REFERENCE`'s,
    and whether all are within the tolerance (module docstring)."""
    o_ref, s_ref = (t.double() for t in outs[REFERENCE])
    o_scale, s_scale = o_ref.abs().max().item(), s_ref.abs().max().item()
    errors, ok = {}, True
    for name, (o, s) in outs.items():
        if name == REFERENCE:
            continue
        do, ds = (o.double() - o_ref).abs(), (s.double() - s_ref).abs()
        good = bool(torch.isfinite(do).all() and torch.isfinite(ds).all()) and \
            bool((do <= 2**-7 * o_ref.abs() + 1e-4 * o_scale).all()) and ds.max().item() <= 1e-4 * s_scale
        errors[name] = dict(out=do.max().item(), state=ds.max().item(), agree=good)
        ok &= good
    return dict(errors, ref_out_max=o_scale, ref_state_max=s_scale), ok


def time_us(sets: list[dict[str, Contender]], reps: int, dev: str) -> dict[str, float]:
    """Median µs of one call of each contender (module docstring), interleaved."""
    names = list(sets[0])
    times = {n: [] for n in names}
    if dev == "cpu":
        for _ in range(reps):
            for n in names:
                t0 = time.perf_counter()
                for s in sets:
                    s[n].run()
                times[n].append((time.perf_counter() - t0) * 1e6 / len(sets))
        return {n: statistics.median(t) for n, t in times.items()}
    from specla.cuda.capture import record_graph

    graphs = {n: record_graph(lambda n=n: [s[n].run() for s in sets], dev) for n in names}
    for r in range(3 + reps):
        for n, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            if r >= 3:
                times[n].append(a.elapsed_time(b) * 1e3 / len(sets))
    return {n: statistics.median(t) for n, t in times.items()}


def run_cell(eng, op, shape: dict, N, kind, D, args, seed) -> dict:
    dev, dtype = args.device, getattr(torch, args.dtype)
    build = OPS[op].contenders[kind]
    inputs = lambda i: cell_inputs(op, shape, N, D, kind == "tree", dtype, dev, seed + i)  # noqa: E731
    x0 = inputs(0)
    first = {n: f(x0, eng) for n, f in build.items()}
    outs = {n: (c.run(), c.committed()) for n, c in first.items()}
    errors, agree = check(outs)
    del outs
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in x0.layer.values()}
    copies = 1 if dev == "cpu" else copies_for(N * x0.pool[0].nbytes + sum(storages.values()))
    sets = [first] + [{n: f(inputs(i), eng) for n, f in build.items()} for i in range(1, copies)]
    us = time_us(sets, args.reps, dev)
    mem = {n: dict(slot_bytes=c.slot_bytes, spec_bytes=c.spec_bytes) for n, c in first.items()}
    return dict(op=op, **shape, batch=N, workload=f"{kind}{D}", input_sets=copies, us=us, memory=mem, errors=errors,
                agree=agree)


def memory_rows(cells: list[dict], shapes: dict, budget_gib: float) -> list[dict]:
    """Per model, rank and workload: bytes a running request holds, one layer and all the model's
    layers of that op, and the running requests that fit in the budget (one rank)."""
    rows, seen = [], set()
    for c in cells:
        for model, tp in shapes[(c["op"], *(c[k] for k in OPS[c["op"]].dims))]:
            if (model, tp, c["workload"]) in seen:
                continue
            seen.add((model, tp, c["workload"]))
            layers = MODELS[model]["layers"]
            for name, m in c["memory"].items():
                per_layer = m["slot_bytes"] + m["spec_bytes"]
                rows.append(dict(op=c["op"], model=model, tp=tp, workload=c["workload"], contender=name,
                                 layer_bytes=per_layer,
                                 spec_layer_bytes=m["spec_bytes"], model_bytes=per_layer * layers,
                                 requests_in_budget=int(budget_gib * 2**30 // (per_layer * layers))))
    return rows


def markdown(report: dict) -> str:
    lines = [f"Verify + commit, one layer of one rank, µs per call ({report['meta']['device']}); "
             f"errors against {REFERENCE}", "",
             "| op | models (TP) | shape | batch | workload | " + " | ".join(NAMES)
             + " | agree | max err out / state |",
             "|---" * (7 + len(NAMES)) + "|"]
    for c in report["cells"]:
        shape = " ".join(f"{k}{c[k]}" for k in OPS[c["op"]].dims)
        errs = "; ".join(f"{n} {e['out']:.1e} / {e['state']:.1e}" for n, e in c["errors"].items()
                         if isinstance(e, dict))
        lines.append(f"| {c['op']} | {c['models']} | {shape} | {c['batch']} | {c['workload']} | "
                     + " | ".join(f"{c['us'][n]:.1f}" if n in c["us"] else "-" for n in NAMES)
                     + f" | {'yes' if c['agree'] else '**NO**'} | {errs} |")
    for u in report.get("unfit", ()):
        lines.append(f"| {u['op']} | {u['models']} | | {u['batch']} | {u['workload']} | "
                     f"out of GPU memory: {u['error']} |")
    if any("vllm_fused_mtp" in c["us"] for c in report["cells"]):
        lines += ["", "vllm_fused_mtp: vLLM's ROCm Triton port of the compiled CUDA op its GDN layer runs by default "
                  "on NVIDIA (`fused_gdn_decode_post_conv_mtp`), a stand-in, not the CUDA kernel itself; timed without "
                  "its fused output norm's launch."]
    lines += ["", f"Memory a running request holds (state slot + speculation buffers), requests in "
              f"{report['args']['budget_gib']} GiB a rank", "",
              "| op | model | TP | workload | contender | KiB a layer | of which speculation | "
              "MiB all the op's layers | requests |", "|---" * 9 + "|"]
    lines += [f"| {m['op']} | {m['model']} | {m['tp']} | {m['workload']} | {m['contender']} | "
              f"{m['layer_bytes'] / 2**10:.1f} | {m['spec_layer_bytes'] / 2**10:.1f} | "
              f"{m['model_bytes'] / 2**20:.1f} | {m['requests_in_budget']} |" for m in report["memory"]]
    return "\n".join(lines) + "\n"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _int_pair(s: str) -> tuple[int, int]:
    """``"A,B"`` as two integers; ``(0, 0)``, which every such option refuses, for anything else."""
    return tuple(ints(s)) if re.fullmatch(r"\d+,\d+", s) else (0, 0)


def _tile(t: int, least: int = 16) -> bool:
    """A tile width a kernel takes: a power of two of at least ``least`` (16 where it feeds tl.dot)."""
    return t >= least and not t & (t - 1)


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, prog: str) -> dict | None:
    """The arguments of a timing run checked, the preset's defaults filled in; returns the per-rank
    shapes to time, ``{(op, *dims): [(model, tp)]}`` (models of one shape are timed once), or
    ``None`` after printing why the device cannot run them (``ap.error`` exits on the others)."""
    if not args.out:
        ap.error("--out is required (except with --extract)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU; torch sees none (--device cpu under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return None
    for name, value in PRESETS[args.preset].items():  # an option given empty ("--trees=") is none
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    for name in ("models", "tp", "batches", "dtype"):
        if not [x for x in getattr(args, name).split(",") if x]:
            ap.error(f"--{name} is empty")
    if not ints(args.trees) and not ints(args.chains):
        ap.error("--trees and --chains are both empty: nothing to time")
    ops = args.ops.split(",")
    if set(ops) - set(OPS):
        ap.error(f"--ops: unknown {', '.join(sorted(set(ops) - set(OPS)))} (of {', '.join(OPS)})")
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))} (of {', '.join(MODELS)})")
    shapes: dict[tuple, list] = {}
    for model in (m for m in args.models.split(",") if MODELS[m]["op"] in ops):
        m, op = MODELS[model], OPS[MODELS[model]["op"]]
        for tp in ints(args.tp):
            if any(m[k] % tp for k in op.split):
                ap.error(f"{model}'s " + ", ".join(f"{k} {m[k]}" for k in op.split) + f" do not split over TP {tp}")
            shapes.setdefault((m["op"], *(m[k] // tp if k in op.split else m[k] for k in op.dims)), []).append(
                (model, tp))
    if not shapes:
        ap.error(f"no model of --ops {args.ops} in --models {args.models}")
    return shapes


def main(argv=None) -> int:
    ap = add_allow_dirty(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--out", help="JSON report path (the tables go to the same path with .md)")
    ap.add_argument("--extract", metavar="DIR", help="copy both engines' kernel files into DIR (same layout) and exit")
    ap.add_argument("--kernels", metavar="DIR", help="read the engines' kernel files from DIR (--extract's layout) "
                                                     "instead of the per-user cache")
    ap.add_argument("--preset", choices=PRESETS, default="full")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}: the preset's (or "
                                                         "--models') models of these ops (default: all)")
    for name in ("models", "tp", "batches", "trees", "chains", "dtype"):
        ap.add_argument(f"--{name}", help=f"comma-separated; default: the preset's ({PRESETS['full'][name]} for full)"
                        + (f"; empty (--{name}=) for none" if name in ("trees", "chains") else ""))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50, help="timed rounds (median)")
    ap.add_argument("--budget-gib", type=float, default=10.0,
                    help="memory a rank gives running requests' states and speculation buffers of the op's layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree-inverse", choices=("auto", *gdn_verify.INVERSE_FORMS),
                    default=gdn_verify.TUNING["tree"]["inverse"],
                    help="the GDN tree kernel's forward substitution, T = (I + A)^-1 (specla.mixers.gdn.verify.TUNING)")
    ap.add_argument("--tree-tiles", metavar="BV,BKC", help="the GDN tree kernel's V tile and K block where its "
                    "prepare runs apart (TUNING[\"tree\"][\"tiles\"][\"separate\"]), powers of two >= 16")
    ap.add_argument("--mamba2-tree", metavar="BP,WARPS", help="the Mamba2 tree kernel's widest P tile (a power of "
                    "two >= 16) and warps (specla.mixers.mamba2.verify.TUNING)")
    ap.add_argument("--mamba2-serial", metavar="BP,WARPS", help="the Mamba2 serial (chain) kernel's widest P tile "
                    "(a power of two) and warps (specla.mixers.mamba2.verify.TUNING)")
    ap.add_argument("--kda-serial", metavar="BV,WARPS", help="the KDA serial (chain) kernel's V tile (a power of two) "
                    "and warps (specla.mixers.kda.verify.TUNING)")
    ap.add_argument("--kda-tree-prepare", choices=kda_verify.PREPARE_FORMS,
                    default=kda_verify.TUNING["tree"]["prepare"],
                    help="where the KDA tree kernel's substitution matrices are built: in each verify program "
                         "(fused) or once by a prepare launch (separate) (specla.mixers.kda.verify.TUNING)")
    ap.add_argument("--mamba2-stages", type=int, choices=(1, 2, 3, 4),
                    default=mamba2_verify.TUNING["tree"]["num_stages"], help="the Mamba2 tree kernel's pipeline stages (specla.mixers.mamba2.verify.TUNING)")
    ap.add_argument("--mamba2-split", type=int, choices=(16, 32, 64, 128),
                    default=mamba2_verify.TUNING["tree"]["BN_split"], help="the Mamba2 tree kernel's block of the "
                    f"state size N where N exceeds {mamba2_verify.TUNING['tree']['BN']} (default %(default)s; "
                    "specla.mixers.mamba2.verify.TUNING)")
    ap.add_argument("--mamba2-dot", choices=("ieee", "tf32x3"), default=mamba2_verify.TUNING["tree"]["dot"],
                    help="the Mamba2 tree kernel's products' precision where the activations are not float32 "
                         "(specla.mixers.mamba2.verify.TUNING)")
    args = ap.parse_args(argv)
    m2 = {}
    for launch, least in (("tree", 16), ("serial", 1)):
        m2[launch] = dict(mamba2_verify.TUNING[launch])
        given = getattr(args, f"mamba2_{launch}")
        if given:
            bp, warps = _int_pair(given)
            if not _tile(bp, least) or warps not in (1, 2, 4, 8, 16):
                at_least = f" >= {least}" if least > 1 else ""
                ap.error(f"--mamba2-{launch}: BP,WARPS with BP a power of two{at_least} and WARPS one of 1, 2, 4, "
                         f"8, 16, got {given!r}")
            m2[launch].update(BP=bp, num_warps=warps)
    m2["tree"].update(dot=args.mamba2_dot, num_stages=args.mamba2_stages, BN_split=args.mamba2_split)
    kda_serial = dict(kda_verify.TUNING["serial"])
    if args.kda_serial:
        bv, warps = _int_pair(args.kda_serial)
        if not _tile(bv, 1) or warps not in (1, 2, 4, 8, 16):
            ap.error(f"--kda-serial: BV,WARPS with BV a power of two and WARPS one of 1, 2, 4, 8, 16, got "
                     f"{args.kda_serial!r}")
        kda_serial.update(BV=bv, num_warps=warps)
    tree = dict(gdn_verify.TUNING["tree"], inverse=args.tree_inverse)
    if args.tree_tiles:
        tiles = _int_pair(args.tree_tiles)
        if not all(map(_tile, tiles)):
            ap.error(f"--tree-tiles: two powers of two >= 16 as BV,BKC, got {args.tree_tiles!r}")
        tree["tiles"] = {**tree["tiles"], "separate": tiles}
    saved = gdn_verify.TUNING["tree"], dict(mamba2_verify.TUNING), dict(kda_verify.TUNING)
    gdn_verify.TUNING["tree"], kda_verify.TUNING["serial"] = tree, kda_serial
    kda_verify.TUNING["tree"] = dict(kda_verify.TUNING["tree"], prepare=args.kda_tree_prepare)
    mamba2_verify.TUNING.update(m2)
    try:
        return _run(ap, args)
    finally:  # the kernels' settings are the library's again for whoever calls next in this process
        gdn_verify.TUNING["tree"] = saved[0]
        mamba2_verify.TUNING.update(saved[1])
        kda_verify.TUNING.update(saved[2])


def _run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """:func:`main` after its arguments are parsed and the kernels' settings made."""
    prog = Path(sys.argv[0]).name
    if not args.extract:
        shapes = _check_args(ap, args, prog)  # every argument checked before the engines load
        if shapes is None:
            return 2
    try:
        if args.extract:
            print("\n".join(str(p) for p in engine_kernels.extract(args.extract, args.kernels)))
            return 0
        eng = SimpleNamespace(sglang=engine_kernels.load_sglang(args.kernels),
                              vllm=engine_kernels.load_vllm(args.kernels),
                              vllm_mtp=engine_kernels.load_vllm_mtp(args.kernels, norm=False),
                              vllm_kda=engine_kernels.load_vllm_kda(args.kernels),
                              vllm_mamba2=engine_kernels.load_vllm_mamba2(args.kernels))
    except (engine_kernels.RegistryUnreachable, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    meta = provenance(args.device, args.allow_dirty)
    meta["engines"] = {e["name"]: e["version"] for e in engine_kernels.ENGINES}
    meta["gdn_tree_tuning"] = gdn_verify.TUNING["tree"]  # specla's tree kernel settings this run timed
    meta["mamba2_tree_tuning"] = mamba2_verify.TUNING["tree"]
    meta["mamba2_serial_tuning"] = mamba2_verify.TUNING["serial"]
    meta["kda_serial_tuning"] = kda_verify.TUNING["serial"]
    meta["kda_tree_tuning"] = kda_verify.TUNING["tree"]
    # what SGLang's kernel picked its launch from (tiles for the tree verify on SM90; PDL)
    meta["sglang_probes"] = dict(sm90=eng.sglang.recurrent._is_sm90, pdl=eng.sglang.recurrent.is_arch_support_pdl())
    cells, unfit = [], []  # unfit: the cells that ran out of GPU memory
    work = [("tree", D) for D in ints(args.trees)] + [("chain", D) for D in ints(args.chains)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> dict:
        """The report of the cells so far, rewritten after each (a run cut short keeps them;
        ``complete`` says whether it ran every cell)."""
        report = dict(meta=meta, args=vars(args), complete=complete, cells=cells, unfit=unfit,
                      memory=memory_rows(cells, shapes, args.budget_gib))
        out.write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(markdown(report))
        return report

    # Triton's interpreter (the CPU) needs the engines' Mamba2 masks read as bool
    with engine_kernels.interpreter_bool_masks():
        for (op, *dims), users in shapes.items():
            shape = dict(zip(OPS[op].dims, dims))
            for N in ints(args.batches):
                for kind, D in work:
                    models = ", ".join(f"{m} ({tp})" for m, tp in users)
                    try:
                        c = run_cell(eng, op, shape, N, kind, D, args, seed=args.seed + 1000 * N + D)
                    except torch.OutOfMemoryError as err:
                        # SGLang's per-node states outgrow one card first (Nemotron-H-56B at TP 2:
                        # 64 GiB at batch 128 with 64 nodes); the cell is named, the sweep goes on
                        unfit.append(dict(op=op, **shape, models=models, batch=N, workload=f"{kind}{D}",
                                          error=str(err).splitlines()[0]))
                        print(json.dumps(dict(unfit=unfit[-1])), flush=True)
                        del err
                        torch.cuda.empty_cache()
                        write(complete=False)
                        continue
                    c["models"] = models
                    cells.append(c)
                    print(json.dumps(c), flush=True)
                    write(complete=False)
    print(markdown(write(complete=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
