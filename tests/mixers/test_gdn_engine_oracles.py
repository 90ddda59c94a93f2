"""specla's GDN verify and commit on a serving engine's data (``specla.mixers.gdn.serving``)
against the engines' own published Triton kernels, on ``engine_cases.DEV``: compiled on a CUDA
machine, under Triton's interpreter on the CPU.

The engines' kernel files come from the package registry at test time, at pinned versions
(:mod:`specla.testing.engine_kernels`: downloaded once into a per-user cache, imported by file
with the two package-level helpers they import stubbed). Without network the tests skip, saying
so.

Oracles: SGLang 0.5.23's per-node tree verify (``fused_sigmoid_gating_delta_rule_update`` with
``retrieve_parent_token`` and ``intermediate_states_buffer``, as ``TritonGDNKernel.target_verify``
calls it; the committed state is the accepted node's snapshot) and its ReplaySSM fold (the
compact-record chain: ring-written raw inputs replayed on commit); vLLM 0.34.0's chain
speculative kernel (one state slot per draft position) and the Triton port of its fused MTP
decode (the same slots, its output's gated RMSNorm fused). Tolerances: the largest errors
observed (noted at each assertion) with a margin of about 10x.
"""

from __future__ import annotations

import re

import pytest
import torch

from specla.mixers.gdn.serving import GDNRecordBuffers, empty_record_buffers, gdn_pool_commit, gdn_pool_verify
from specla.ops.naive import root_path
from specla.testing import engine_kernels
from engine_cases import CHAIN_ACCEPTED, CHAIN_LENS, DEV, accepted_positions, chain_cu_seqlens, load_or_skip
from tree_speculation import plain_decode, speculate


@pytest.fixture(scope="module")
def sglang():
    """SGLang 0.5.23's GDN recurrent kernel module and its ReplaySSM fold module."""
    return load_or_skip(engine_kernels.load_sglang)


@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.34.0's GDN gated-recurrence kernel module (its chain speculative path)."""
    return load_or_skip(engine_kernels.load_vllm)


@pytest.fixture(scope="module")
def vllm_mtp():
    """vLLM 0.34.0's Triton port of its fused MTP decode, as vLLM runs it (``fused``) and without
    its gated-RMSNorm launch (``unnormed``), and vLLM's PyTorch reference of that norm."""
    return load_or_skip(lambda: dict(fused=engine_kernels.load_vllm_mtp(),
                                     unnormed=engine_kernels.load_vllm_mtp(norm=False),
                                     norm=engine_kernels.load_vllm_norm()))


H, HV, K, V = 2, 4, 16, 16


def _layer(T_total: int, seed: int, hv: int = HV, dtype: torch.dtype = torch.float32, dv: int = V):
    """One layer's verify inputs as SGLang hands them over: q, k, v strided views of one packed
    projection ``[1, Ttot, ...]`` (value head dim ``dv``), raw gate inputs ``a, b [Ttot, HV]``
    (in ``dtype``), ``A_log``, ``dt_bias`` (float32); on :data:`DEV`."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T_total, 2 * H * K + hv * dv, generator=gen).to(dtype).to(DEV)
    q, k, v = torch.split(mixed, [H * K, H * K, hv * dv], dim=-1)
    q, k, v = q.view(1, T_total, H, K), k.view(1, T_total, H, K), v.view(1, T_total, hv, dv)
    a = torch.randn(T_total, hv, generator=gen).to(dtype)
    b = torch.randn(T_total, hv, generator=gen).to(dtype)
    A_log = torch.rand(hv, generator=gen) * 2 - 1
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    return dict(A_log=A_log.to(DEV), a=a.to(DEV), dt_bias=dt_bias.to(DEV), q=q, k=k, v=v, b=b.to(DEV))


def _pool(slots: int, seed: int, hv: int = HV, dv: int = V) -> torch.Tensor:
    """A state pool ``[slots, HV, dv, K]`` float32 of states of a decoded sequence's size, on
    :data:`DEV`."""
    return (torch.randn(slots, hv, dv, K, generator=torch.Generator().manual_seed(seed)) * 0.3).to(DEV)


def _specla(layer, pool, cache_indices, row_indices, qsl, steps, parents, paths, rows, hv=HV):
    """specla's verify and commit on the pool (a copy); returns ``o`` and the pool after the
    commit, and checks that the verify left the pool bit-identical."""
    pool = pool.clone()
    before = pool.clone()
    records = empty_record_buffers(rows, steps, H, hv, K, pool.shape[2], DEV)
    o = gdn_pool_verify(softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=pool,
                        initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=qsl,
                        records=records, intermediate_state_indices=row_indices, cache_steps=steps,
                        retrieve_parent_token=parents, **layer)
    assert torch.equal(pool, before)  # the verify reads the pool only
    accept_index, accept_lens = accepted_positions(paths, steps, steps)
    gdn_pool_commit(pool, cache_indices, records, row_indices, accept_index, accept_lens, steps)
    return o, pool


@pytest.fixture(params=["fused", "separate"])
def prepare(request, monkeypatch):
    """Both forms of the tree kernels' prepare (inside each verify program, or its own launch)."""
    import specla.mixers.gdn.verify as gdn_verify

    monkeypatch.setitem(gdn_verify.TUNING, "tree", {**gdn_verify.TUNING["tree"], "prepare": request.param})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_verify_and_commit_equal_sglang_per_node_snapshots(sglang, prepare, dtype):
    """Ragged 6-node trees (a different shape a row), rows whose root alone is accepted: specla's
    outputs and committed states against SGLang's tree verify and its snapshot commit, with
    either form of the prepare, activations in float32 or bfloat16 (states float32)."""
    D, N, slots = 6, 4, 7
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0], [-1, 0, 1, 1, 3, 3]]
    leaves = [4, 5, 0, 5]  # row 2: the root alone is accepted
    paths = [root_path(t, leaf) for t, leaf in zip(trees, leaves)]
    paths[3] = paths[3][:2]  # a path ending inside the tree
    layer = _layer(N * D, seed=0, dtype=dtype)
    pool = _pool(slots, seed=1)
    cache_indices = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=DEV)
    row_indices = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEV)  # record / scratch row of each request
    qsl = torch.arange(0, N * D + 1, D, dtype=torch.int32, device=DEV)
    parents = torch.tensor(trees, dtype=torch.int64, device=DEV)

    ref_pool = pool.clone()
    scratch = torch.zeros(N, D, HV, V, K, device=DEV)
    o_ref = sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
        softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=ref_pool, initial_state_indices=cache_indices,
        cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True,
        intermediate_states_buffer=scratch, intermediate_state_indices=row_indices, cache_steps=D,
        retrieve_parent_token=parents, **layer)
    assert torch.equal(ref_pool, pool)
    for n, p in enumerate(paths):  # SGLang's commit: the last accepted node's snapshot into the slot
        ref_pool[cache_indices[n]] = scratch[row_indices[n], p[-1]]

    o, committed = _specla(layer, pool, cache_indices, row_indices, qsl, D, parents, paths, N)
    assert o.dtype == o_ref.dtype == dtype
    # float32: observed 1.0e-7 (outputs up to 0.24); bfloat16: observed equal, allowed one bf16 ulp
    tol = 1e-6 if dtype == torch.float32 else 2**-8 * o_ref.float().abs() + 1e-6
    assert ((o.float() - o_ref.float()).abs() <= tol).all()
    assert (committed - ref_pool).abs().max() < 1.5e-6  # observed 1.2e-7, 2.4e-7 in bf16 (states moved by 1.6)
    assert torch.equal(committed[[1, 2, 4]], pool[[1, 2, 4]])  # slots of no row: untouched


def _chains(hv: int = 2):
    """Packed chains of :data:`CHAIN_LENS` tokens (``cu_seqlens``), their layer inputs and pool."""
    qsl = chain_cu_seqlens()
    return qsl, _layer(int(qsl[-1]), seed=2, hv=hv), _pool(4, seed=3, hv=hv)


def _specla_chains(layer, pool, cache_indices, qsl, hv):
    """specla's verify and commit of :func:`_chains`' rows, the compact layout (positions of row
    ``n`` offset by ``n * steps`` in ``accept_index``)."""
    steps = max(CHAIN_LENS)
    paths = [list(range(m)) for m in CHAIN_ACCEPTED]
    rows = torch.arange(len(CHAIN_LENS), dtype=torch.int64, device=DEV)
    return _specla(layer, pool, cache_indices, rows, qsl, steps, None, paths, len(CHAIN_LENS), hv=hv)


def test_chain_verify_and_commit_equal_vllm_per_position_slots(vllm, prepare):
    """vLLM's chain speculative kernel writes the state after every position into its own slot
    (``ssm_state_indices [N, T]``) and reads the committed one from the slot of the last accepted
    position: specla's outputs and committed states against it, on ragged chains up to 48 long."""
    qsl, layer, pool = _chains()
    N, T = len(CHAIN_LENS), max(CHAIN_LENS)
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    # vLLM's pool: slot 0 is its null block; row n's positions take slots 1 + n * T + t
    vpool = torch.zeros(1 + N * T, 2, V, K, device=DEV)
    slots = 1 + torch.arange(N * T, dtype=torch.int32, device=DEV).view(N, T)
    vpool[slots[:, 0].long()] = pool[cache_indices.long()]
    o_ref, _ = vllm.fused_sigmoid_gating_delta_rule_update(
        initial_state=vpool, inplace_final_state=True, cu_seqlens=qsl, ssm_state_indices=slots,
        num_accepted_tokens=torch.ones(N, dtype=torch.int32, device=DEV), use_qk_l2norm_in_kernel=True, **layer)

    o, committed = _specla_chains(layer, pool, cache_indices, qsl, hv=2)
    assert (o - o_ref).abs().max() < 3e-6  # observed 3.1e-7 (outputs up to 0.26)
    ref = torch.stack([vpool[slots[n, m - 1]] for n, m in enumerate(CHAIN_ACCEPTED)])
    assert (committed[cache_indices.long()] - ref).abs().max() < 1.5e-6  # observed 1.2e-7 (moved by 1.3)
    assert torch.equal(committed[1], pool[1])


# chains for the fused MTP decode, which vLLM runs for at most 9 tokens a row
# (MAX_FUSED_GDN_MTP_TOKENS): the tokens a row, how many of the previous step's tokens were
# accepted (the slot its start state is read from) and how many of this step's are
MTP_LENS, MTP_PREV_ACCEPTED, MTP_ACCEPTED = [9, 4, 1, 6], [2, 9, 1, 4], [9, 2, 1, 5]


@pytest.mark.parametrize("compute_units", [1, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_verify_and_commit_equal_vllm_fused_mtp_decode_triton_port(vllm_mtp, monkeypatch, dtype, compute_units):
    """vLLM's Triton port of its fused MTP decode (``fused_gdn_decode_post_conv_mtp_triton``, the
    stand-in for the compiled CUDA op its NVIDIA default runs) reads q, k, v from the packed
    projection and the raw gates; starts row ``n`` from the state in slot ``state_indices[n,
    num_accepted_tokens[n] - 1]`` and writes the state after position ``t`` to slot
    ``state_indices[n, t]``; its outputs are gated-RMSNormed in place. Ragged chains of up to 9
    tokens (its limit in vLLM), value head dim 64 (its least), the value dim split in two tiles or
    not (``compute_units``: the GPU size its tiling heuristic reads), activations float32 or
    bfloat16, states float32. Against specla's verify and commit: its outputs without the norm
    (the port with its norm launch skipped), the committed state of the accepted position, and its
    normed outputs against vLLM's norm reference (``RMSNormGated.forward_static``) applied to
    specla's outputs, for both of vLLM's gate activations."""
    N, T, dv, hv, eps = len(MTP_LENS), max(MTP_LENS), 64, 4, 1e-6
    qsl = chain_cu_seqlens(MTP_LENS)
    layer, pool = _layer(int(qsl[-1]), seed=7, hv=hv, dtype=dtype, dv=dv), _pool(5, seed=8, hv=hv, dv=dv)
    q, tokens = layer["q"], int(qsl[-1])
    mixed_qkv = q.as_strided((tokens, q.stride(1)), (q.stride(1), 1))  # the projection q, k, v are views of
    cache_indices = torch.tensor([2, 0, 4, 3], dtype=torch.int32, device=DEV)
    prev = torch.tensor(MTP_PREV_ACCEPTED, dtype=torch.int32, device=DEV)
    # vLLM's pool: slot 0 is its null block; row n's positions take slots 1 + n * T + t
    slots = 1 + torch.arange(N * T, dtype=torch.int32, device=DEV).view(N, T)
    vpool = torch.zeros(1 + N * T, hv, dv, K, device=DEV)
    vpool[slots[torch.arange(N, device=DEV), prev.long() - 1].long()] = pool[cache_indices.long()]
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(tokens, hv, dv, generator=gen).to(dtype).to(DEV)
    weight = (1 + 0.2 * torch.randn(dv, generator=gen)).to(dtype).to(DEV)

    def port(module, activation):
        monkeypatch.setattr(module, "num_compute_units", lambda device_id: compute_units)
        states, out = vpool.clone(), torch.empty(tokens, hv, dv, dtype=dtype, device=DEV)
        module.fused_gdn_decode_post_conv_mtp_triton(
            mixed_qkv=mixed_qkv, a=layer["a"], b=layer["b"], A_log=layer["A_log"], dt_bias=layer["dt_bias"],
            state_indices=slots, cu_seqlens=qsl, num_accepted_tokens=prev, state=states, output_gate=z,
            norm_weight=weight, out=out, scale=K**-0.5, norm_eps=eps, output_gate_activation=activation)
        return out, states

    o_ref, states = port(vllm_mtp["unnormed"], "silu")
    paths = [list(range(m)) for m in MTP_ACCEPTED]
    o, committed = _specla(layer, pool, cache_indices, torch.arange(N, device=DEV), qsl, T, None, paths, N, hv=hv)
    o = o.view(tokens, hv, dv)
    assert o.dtype == o_ref.dtype == dtype
    # float32: observed 5.6e-8 (outputs up to 0.33); bfloat16: observed equal, allowed one bf16 rounding
    tol = 6e-7 if dtype == torch.float32 else 2**-8 * o_ref.float().abs() + 1e-6
    assert ((o.float() - o_ref.float()).abs() <= tol).all()
    ref = torch.stack([states[slots[n, m - 1]] for n, m in enumerate(MTP_ACCEPTED)])
    # observed 1.8e-7, 3.0e-7 with bfloat16 activations (states moved by 1.4)
    assert (committed[cache_indices.long()] - ref).abs().max() < 3e-6
    assert torch.equal(committed[1], pool[1])
    for activation in ("silu", "sigmoid"):
        normed, normed_states = port(vllm_mtp["fused"], activation)
        assert torch.equal(normed_states, states)  # the norm launch writes no state
        o_norm = vllm_mtp["norm"](o, z, weight, eps, dtype, activation=activation)
        d = (o_norm.float() - normed.float()).abs()
        # float32: observed 3.8e-6 (outputs up to 6.5); bfloat16: observed one bf16 ulp (the port
        # and the reference sum, scale and round in different orders), allowed one ulp
        tol = 4e-5 if dtype == torch.float32 else 2**-7 * normed.float().abs() + 1e-6
        assert (d <= tol).all()


def test_chain_verify_and_commit_equal_sglang_replayssm_fold(sglang):
    """SGLang's compact-record chains (ReplaySSM, fold on every commit): the verify writes each
    token's raw k, v and gates into a per-slot ring, the commit replays the accepted prefix into
    the checkpoint state. specla's outputs and committed states against both."""
    qsl, layer, pool = _chains()
    L = max(CHAIN_LENS)
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    ref_pool = pool.clone()
    ring = dict(replayssm_rawv=torch.zeros(4, 2, L, V, device=DEV),
                replayssm_rawk=torch.zeros(4, H, L, K, device=DEV),
                replayssm_g=torch.zeros(4, 2, L, device=DEV), replayssm_beta=torch.zeros(4, 2, L, device=DEV))
    o_ref = sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
        softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=ref_pool, initial_state_indices=cache_indices,
        cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True, cache_ring=True,
        **ring, **layer)
    accept_lens = torch.tensor(CHAIN_ACCEPTED, dtype=torch.int32, device=DEV)
    sglang.fold.commit_gdn_replayssm_fold_all_layers(
        ref_pool[None], ring["replayssm_rawv"][None], ring["replayssm_rawk"][None], ring["replayssm_g"][None],
        ring["replayssm_beta"][None], cache_indices, accept_lens, max_cache_len=L, num_k_heads=H)

    o, committed = _specla_chains(layer, pool, cache_indices, qsl, hv=2)
    assert (o - o_ref).abs().max() < 3e-6  # observed 3.1e-7 (outputs up to 0.26)
    assert (committed - ref_pool).abs().max() < 1.5e-6  # observed 1.3e-7 (moved by 1.3)
    assert torch.equal(committed[1], pool[1])


def test_commit_leaves_padding_rows_and_empty_paths_alone():
    """A row with a negative slot, or with no accepted node, writes nothing; the other row
    commits (a change of the state is checked, not its value: the oracles above check those)."""
    steps = 3
    qsl = torch.tensor([0, 3, 5, 7], dtype=torch.int32, device=DEV)
    layer, pool = _layer(7, seed=4, hv=2), _pool(4, seed=5, hv=2)
    cache_indices = torch.tensor([2, -1, 3], dtype=torch.int32, device=DEV)
    records = empty_record_buffers(3, steps, H, 2, K, V, DEV)
    rows = torch.arange(3, dtype=torch.int32, device=DEV)
    gdn_pool_verify(pool.new_zeros(2), layer["a"], layer["dt_bias"], 1.0, 20.0, layer["q"], layer["k"], layer["v"],
                    layer["b"], pool, cache_indices, use_qk_l2norm_in_kernel=True, cu_seqlens=qsl,
                    records=records, intermediate_state_indices=rows)
    committed = pool.clone()
    accept_index, _ = accepted_positions([[0, 1, 2], [0, 1], [0, 1]], steps, steps)
    gdn_pool_commit(committed, cache_indices, records, rows, accept_index, torch.tensor([3, 2, 0], device=DEV), steps)
    assert torch.equal(committed[[0, 1, 3]], pool[[0, 1, 3]])  # slot -1's row and slot 3's empty path
    assert not torch.equal(committed[2], pool[2])


def test_pool_entry_points_reject_bad_input_clearly():
    qsl, layer, pool = _chains()
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    records = empty_record_buffers(3, max(CHAIN_LENS), H, 2, K, V, DEV)
    rows = torch.arange(3, dtype=torch.int32, device=DEV)
    on = re.escape(str(pool.device))  # as the messages name it (cuda:0, not cuda)
    call = dict(softplus_beta=1.0, softplus_threshold=20.0, initial_state_source=pool,
                initial_state_indices=cache_indices, cu_seqlens=qsl, records=records,
                intermediate_state_indices=rows, **layer)
    with pytest.raises(ValueError, match=r"^initial_state_source must be float32 \[slots, 2, 16, 16\] \(V before K\), "
                                         r"got torch.float64 \[4, 2, 16, 16\]$"):
        gdn_pool_verify(**call | dict(initial_state_source=pool.double()))
    with pytest.raises(ValueError, match=r"^the gates take softplus_beta 1.0 and softplus_threshold 20.0, "
                                         r"got 2.0, 20.0$"):
        gdn_pool_verify(**call | dict(softplus_beta=2.0))
    with pytest.raises(ValueError, match=r"^cache_steps must be at most the records' D = 48 and 64, got 49$"):
        gdn_pool_verify(**call | dict(cache_steps=49))
    with pytest.raises(ValueError, match=r"^records must be GDNRecordBuffers, got tuple$"):
        gdn_pool_verify(**call | dict(records=tuple(records)))
    bad = GDNRecordBuffers(records.k, records.delta.to(torch.bfloat16), records.G)
    with pytest.raises(ValueError, match=rf"^records.delta must be float32 \[3, 48, 2, 16\] on {on}, contiguous, got "
                                         rf"torch.bfloat16 \[3, 48, 2, 16\] on {on}$"):
        gdn_pool_verify(**call | dict(records=bad))
    with pytest.raises(ValueError, match=rf"^intermediate_state_indices must be int32 or int64 \[3\] on {on}, got "
                                         r"torch.int32 \[2\]$"):
        gdn_pool_verify(**call | dict(intermediate_state_indices=rows[:2]))
    with pytest.raises(ValueError, match=rf"^accept_index must be int32 or int64 \[3, P\] on {on}, "
                                         r"got torch.int64 \[3\]$"):
        gdn_pool_commit(pool, cache_indices, records, rows, torch.zeros(3, dtype=torch.int64, device=DEV),
                        torch.ones(3, dtype=torch.int64, device=DEV), 48)


class TinyGDNModel:
    """A two-layer GDN language model of random weights (vocabulary 5, width 32, no short conv,
    which the engine keeps outside the recurrent kernels): ``h += (gdn(q, k, v, a, b)) W_o`` a
    layer, ``gdn`` being the caller's kernel call on its state pool ``pools[layer]``. Its weights
    are on :data:`DEV`."""

    vocab, width, layers = 5, 32, 2

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEV)  # noqa: E731
        d = self.width
        self.emb = r(self.vocab, d)
        self.lm = r(d, self.vocab, scale=d**-0.5)
        self.w = [dict(qkv=r(d, 2 * H * K + HV * V, scale=d**-0.5), a=r(d, HV, scale=d**-0.5),
                       b=r(d, HV, scale=d**-0.5), out=r(HV * V, d, scale=(HV * V) ** -0.5),
                       A_log=r(HV, scale=0.5), dt_bias=r(HV, scale=0.5)) for _ in range(self.layers)]

    def logits(self, tokens: torch.Tensor, gdn) -> torch.Tensor:
        """``[Ttot, vocab]`` of packed ``tokens [Ttot]``; ``gdn(layer, A_log, a, dt_bias, q, k, v,
        b) -> o [1, Ttot, HV, V]``, q, k, v strided views of one projection as SGLang's."""
        h = self.emb[tokens]
        T = tokens.shape[0]
        for i, w in enumerate(self.w):
            q, k, v = torch.split(h @ w["qkv"], [H * K, H * K, HV * V], dim=-1)
            o = gdn(i, w["A_log"], h @ w["a"], w["dt_bias"], q.view(1, T, H, K), k.view(1, T, H, K),
                    v.view(1, T, HV, V), h @ w["b"])
            h = h + o.reshape(T, HV * V) @ w["out"]
        return h @ self.lm


def _plain_step(model, sglang, pools, cache_indices, tokens):
    """One token a row through SGLang's own decode kernel (states updated in place)."""
    qsl = torch.arange(tokens.shape[0] + 1, dtype=torch.int32, device=DEV)

    def gdn(i, A_log, a, dt_bias, q, k, v, b):
        return sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0, q=q, k=k, v=v, b=b,
            initial_state_source=pools[i], initial_state_indices=cache_indices, cu_seqlens=qsl,
            use_qk_l2norm_in_kernel=True)

    return model.logits(tokens, gdn)


def test_tree_speculation_through_a_small_model_is_token_identical_to_the_engines_plain_decoding(sglang):
    """Greedy decoding of a small random GDN model, two rows in state slots 3 and 1: plain, one
    token a step through SGLang's decode kernel, against speculation on ragged random draft trees
    (6 and 4 nodes, root included) through ``gdn_pool_verify`` and ``gdn_pool_commit`` (every
    layer in one launch). The
    drafter knows part of the answer (a random-depth branch of the plain tokens, the other
    branches wrong), so steps accept from nothing to a whole branch. Tokens must be identical."""
    model, new = TinyGDNModel(seed=6), 12
    prompts = torch.tensor([[1, 4, 2, 0], [3, 3, 1, 2]], device=DEV)
    N, slots, sizes = 2, 5, [6, 4]
    cache_indices = torch.tensor([3, 1], dtype=torch.int32, device=DEV)

    pools = [torch.zeros(slots, HV, V, K, device=DEV) for _ in range(model.layers)]
    plain = plain_decode(lambda tokens: _plain_step(model, sglang, pools, cache_indices, tokens), prompts, new)

    pools = torch.zeros(model.layers, slots, HV, V, K, device=DEV)  # every layer's pool, committed in one launch
    for t in range(prompts.shape[1] - 1):  # the prompt but its last token, which roots the first tree
        _plain_step(model, sglang, pools, cache_indices, prompts[:, t])
    rows = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    # every layer's records in one buffer, a layer's k, delta and G blocks one after another
    blocks = [N * max(sizes) * w for w in (H * K, HV * V, HV)]
    buf = torch.empty(model.layers, sum(blocks), device=DEV).split(blocks, dim=1)
    records = GDNRecordBuffers(*(x.view(model.layers, N, max(sizes), *tail)
                                 for x, tail in zip(buf, [(H, K), (HV, V), (HV,)])))
    width = max(sizes)

    def verify(toks, qsl, parents):
        def gdn(i, A_log, a, dt_bias, q, k, v, b):
            return gdn_pool_verify(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pools[i], cache_indices,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=qsl, records=records.layer(i),
                                   intermediate_state_indices=rows, cache_steps=width,
                                   retrieve_parent_token=parents)

        return model.logits(torch.tensor(toks, device=DEV), gdn).argmax(-1).tolist()

    def commit(paths):
        accept_index, accept_lens = accepted_positions(paths, width, width)
        gdn_pool_commit(pools, cache_indices, records, rows, accept_index, accept_lens, width)

    out, accepted = speculate(plain, prompts[:, -1].tolist(), sizes, model.vocab, 7, verify, commit)
    assert [o[:new] for o in out] == plain
    assert 0 in accepted and max(accepted) >= 3  # steps accepting nothing, and deep ones
