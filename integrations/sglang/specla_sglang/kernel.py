"""specla's GDN and Mamba2 tree verify and commit on SGLang's data, in place: its state pool by
slot index (read by the verify, committed into by the commit; no state is copied out of it or
transposed, but a request's state into its prefix-cache track slot: :func:`commit_paths`), its
draft tokens, its raw gates or step sizes and its ``retrieve_parent_token``, with factor records
(:mod:`specla_sglang.records`) in the pool's per-node buffer instead of per-node states. They run
:mod:`specla.mixers.gdn.serving`'s and :mod:`specla.mixers.mamba2.serving`'s entry points on views
of the record blocks.

Shapes as SGLang passes them: ``bs`` requests of up to ``D`` draft tokens each (node 0 of each
request is its last committed token). GDN: ``N`` packed tokens, ``H`` key heads, ``HV`` value
heads, ``K``/``V`` head dims, states ``[HV, V, K]`` float32 (V before K). Mamba2: ``[bs, D]``
tokens, ``H`` heads of dim ``P``, ``NG`` groups of ``B``/``C``, state size ``Ns``, states
``[H, P, Ns]`` float32. The entry points take both as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
from sglang.srt.mem_cache.memory_pool import MambaPool
from specla.mixers.gdn.serving import GDNRecordBuffers, gdn_pool_commit, gdn_pool_verify
from specla.mixers.mamba2.serving import Mamba2RecordBuffers, mamba2_pool_commit, mamba2_pool_verify
from specla.tree import inclusive_ancestor_mask

from .records import RecordLayout

# SGLang's gate (fused_sigmoid_gating_delta_rule_update): PyTorch's softplus
_SOFTPLUS_BETA, _SOFTPLUS_THRESHOLD = 1.0, 20.0


def is_record_buffer(buffer: Tensor | None) -> bool:
    """Whether one layer's slice of SGLang's ``intermediate_ssm`` holds this plugin's records
    (``[rows, D, W]``) rather than its per-node states (two dimensions more)."""
    return buffer is not None and buffer.dim() == 3


class RecordState(MambaPool.SpeculativeState):
    """SGLang's speculative state of a pool whose ``intermediate_ssm`` holds this plugin's records,
    of the layers of :attr:`mixer` (the commit reads the kind from the state's class: SGLang's
    per-layer slices and copies of a state keep its class)."""

    mixer: str


class GDNRecordState(RecordState):
    mixer = "gdn"


class Mamba2RecordState(RecordState):
    mixer = "mamba2"


RECORD_STATES = {state.mixer: state for state in (GDNRecordState, Mamba2RecordState)}


def tree_parents(retrieve_parent_token: Tensor | None, bs: int, D: int, device) -> Tensor:
    """``[bs, D]`` int64 parents with node 0 as the root (SGLang leaves its entry 0 unset); a chain
    (node ``t`` the child of ``t - 1``) without ``retrieve_parent_token``."""
    if retrieve_parent_token is None:
        return torch.arange(-1, D - 1, device=device).expand(bs, D)
    parents = retrieve_parent_token[:bs, :D].to(torch.int64).clone()
    parents[:, 0] = -1
    return parents


def verify_tree(
    A_log: Tensor, dt_bias: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, *,
    ssm_states: Tensor, cache_indices: Tensor, query_start_loc: Tensor, records: Tensor,
    record_rows: Tensor, retrieve_parent_token: Tensor | None, cache_steps: int | None = None,
) -> Tensor:
    """One GDN layer's tree verify (:func:`~specla.mixers.gdn.serving.gdn_pool_verify`): outputs
    of every node as if its root path had been decoded serially from the request's state in the
    pool, read in place; its factor records and its tree's parents written to ``records``.

    Args:
        A_log, dt_bias: ``[HV]``; the gate is ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta =
            sigmoid(b)`` (SGLang's).
        q, k: ``[N, H, K]`` or ``[1, N, H, K]``, float32 or bfloat16, token rows may be strided,
            before L2 normalisation.
        v: ``[N, HV, V]`` or ``[1, N, HV, V]``; a, b: ``[N, HV]``.
        ssm_states: ``[slots, HV, V, K]`` float32 state pool of the layer, any strides, read only
            (slot ``cache_indices[i]``; a negative index is a padding request, verified from a
            zero state).
        cache_indices: ``[>= bs]`` int32/int64; query_start_loc: ``[bs + 1]`` int32/int64 packed
            request starts (its length gives ``bs``; requests may differ in draft count).
        records: ``[rows, D, W]`` float32, this layer's record buffer (:mod:`specla_sglang.records`);
            row ``record_rows[i]`` of request ``i`` is written, steps up to its draft count.
        record_rows: ``[>= bs]`` int32/int64; retrieve_parent_token: ``[>= bs, >= cache_steps]`` int
            (entry 0 unused), or ``None`` for chains.
        cache_steps: the most draft tokens a request has (SGLang's ``draft_token_num``), ``<= D``;
            default ``D``.
    Returns:
        ``[1, N, HV, V]`` in ``q.dtype``.
    Raises:
        ValueError: from ``gdn_pool_verify``: shapes or dtypes it does not take (a pool not
            float32, ``cache_steps > D``).
    """
    bs = query_start_loc.shape[0] - 1
    H, K = k.shape[-2:]
    HV, V = v.shape[-2:]
    blocks = RecordLayout(H=H, HV=HV, K=K, V=V).views(records)
    steps = records.shape[1] if cache_steps is None else cache_steps
    rows = record_rows[:bs]
    q, k, v = (x if x.dim() == 4 else x.unsqueeze(0) for x in (q, k, v))
    o = gdn_pool_verify(A_log, a, dt_bias, _SOFTPLUS_BETA, _SOFTPLUS_THRESHOLD, q, k, v, b, ssm_states,
                        cache_indices[:bs], use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc,
                        records=GDNRecordBuffers(*blocks[:3]), intermediate_state_indices=rows, cache_steps=steps,
                        retrieve_parent_token=None if retrieve_parent_token is None else retrieve_parent_token[:bs])
    write_parents(records, blocks[3], rows, retrieve_parent_token, bs, steps)
    return o


def write_parents(records: Tensor, parent: Tensor, rows: Tensor, retrieve_parent_token: Tensor | None, bs: int,
                  steps: int) -> None:
    """Each verified tree's parents (:func:`tree_parents`) into the parent block ``parent [R, D]``
    of a layer's records ``records``, rows ``rows[:bs]``, steps up to ``steps``: the commit finds
    each accepted path from these alone. Every layer verifies the same trees and the commit reads
    the first layer's parents, so only the first layer's records, the view at the start of the
    buffer this plugin allocates (``storage_offset() == 0``), are written; the other layers skip
    the launches."""
    if records.storage_offset() == 0:
        parent[rows[:bs].to(torch.int64), :steps] = tree_parents(retrieve_parent_token, bs, steps, parent.device).float()


def verify_mamba2_tree(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, z: Tensor | None = None,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, state_batch_indices: Tensor | None = None,
    pad_slot_id: int = -1, out: Tensor | None = None, disable_state_update: bool = False, *,
    intermediate_states_buffer: Tensor, cache_steps: int | None = None,
    retrieve_parent_token: Tensor | None = None, intermediate_state_indices: Tensor,
) -> None:
    """One Mamba2 layer's tree verify (:func:`~specla.mixers.mamba2.serving.mamba2_pool_verify`),
    called as SGLang's ``MambaMixer2`` calls ``selective_state_update`` for a target verify:
    outputs of every node as if its root path had been decoded serially from the request's state
    in the pool, read in place, into ``out``; its factor records and its tree's parents written to
    ``intermediate_states_buffer``.

    Args:
        state: ``[slots, H, P, Ns]`` float32 state pool of the layer, any strides, read only (slot
            ``state_batch_indices[i]``; ``pad_slot_id``, negative, marks a padding request,
            verified from a zero state).
        x: ``[bs, D, H, P]``; dt: ``[bs, D, H]`` or its expand over ``P`` (SGLang's); A: ``[H]``
            or its ``[H, P, Ns]`` expand; B, C: ``[bs, D, NG, Ns]``; D: ``[H]`` or its ``[H, P]``
            expand; dt_bias likewise; activations float32 or bfloat16, token rows may be strided.
        z: must be ``None`` (SGLang gates in the norm after the mixer).
        dt_softplus: must be ``True``; disable_state_update: must be ``True`` (a verify).
        out: ``[bs, D, H, P]``, written in place.
        intermediate_states_buffer: ``[rows, D, W]`` float32, this layer's record buffer
            (:mod:`specla_sglang.records`); row ``intermediate_state_indices[i]`` of request
            ``i`` is written.
        cache_steps: SGLang's ``draft_token_num``, ``<= D``; default ``x.shape[1]``.
        retrieve_parent_token: ``[>= bs, >= cache_steps]`` int (entry 0 unused), or ``None``
            for chains.
    Raises:
        ValueError: a state update, a ``z``, a non-negative ``pad_slot_id``; from
            ``mamba2_pool_verify``: shapes or dtypes it does not take (a pool not float32).
    """
    if z is not None or not disable_state_update or pad_slot_id >= 0:
        raise ValueError("specla's Mamba2 tree verify takes no z, does not update the state and reads negative "
                         f"slots as padding; got z={'set' if z is not None else None}, "
                         f"disable_state_update={disable_state_update}, pad_slot_id={pad_slot_id}")
    bs, T, H, P = x.shape
    NG, Ns = B.shape[-2:]
    blocks = RecordLayout(H=NG, HV=H, K=Ns, V=P).views(intermediate_states_buffer)
    steps = T if cache_steps is None else cache_steps
    mamba2_pool_verify(state, x, dt, A, B, C, D, dt_bias, dt_softplus, state_batch_indices[:bs], out=out,
                       records=Mamba2RecordBuffers(*blocks[:3]), intermediate_state_indices=intermediate_state_indices[:bs],
                       cache_steps=steps,
                       retrieve_parent_token=None if retrieve_parent_token is None else retrieve_parent_token[:bs])
    write_parents(intermediate_states_buffer, blocks[3], intermediate_state_indices, retrieve_parent_token, bs, steps)


def commit_paths(
    mixer: str, temporal: Tensor, records: Tensor, slots: Tensor, steps: Tensor, track_slots: Tensor | None = None,
    track_steps: Tensor | None = None, src_rows: Tensor | None = None,
) -> None:
    """Commit, in every layer and in one launch (:func:`~specla.mixers.gdn.serving.gdn_pool_commit`
    or :func:`~specla.mixers.mamba2.serving.mamba2_pool_commit`, by ``mixer``), the root path of node ``steps[i]`` of request ``i`` into its slot ``slots[i]`` (the state the
    tree was verified from), and that of node ``track_steps[i]`` into the prefix cache's track slot
    ``track_slots[i]``, from the records alone (closed form, docs/DESIGN.md section 4). A track slot
    first receives a copy of the request's slot (within the pool, every layer): the commit adds a
    path to the state in the slot it writes.

    Args:
        mixer: ``"gdn"`` or ``"mamba2"``, the layers' kind (:class:`RecordState`).
        temporal: ``[layers, slots, HV, V, K]`` (GDN) or ``[layers, slots, H, P, Ns]`` (Mamba2)
            float32, SGLang's state pool, updated in place.
        records: ``[layers, rows, D, W]`` float32 (:mod:`specla_sglang.records`).
        slots: ``[>= bs]`` int; steps: ``[bs]`` int node of the last token to commit.
        track_slots: ``[>= bs]`` int, or ``None`` (no tracking); track_steps: ``[bs]`` int node whose
            state the track slot takes.
        src_rows: ``[>= bs]`` int record row of each request; ``None``: row ``i`` for request ``i``.
        A negative slot or node leaves that slot untouched (and a negative ``slots[i]`` the
        request's track slot too).
    """
    bs = steps.shape[0]
    device = temporal.device
    layout = RecordLayout.of_buffer(temporal.shape, records.shape[-1])
    blocks = layout.views(records)
    D = records.shape[2]
    base = slots[:bs].to(torch.int64)
    src = torch.arange(bs, device=device) if src_rows is None else src_rows[:bs].to(torch.int64)
    dst, nodes = [base], [steps.to(torch.int64)]
    if track_slots is not None:
        track = track_slots[:bs].to(torch.int64)
        tracked = (track_steps >= 0) & (base >= 0) & (track >= 0)
        temporal[:, track[tracked]] = temporal[:, base[tracked]]
        dst.append(torch.where(tracked, track, -1))
        nodes.append(track_steps.to(torch.int64))
    # one commit row per destination slot: the requests', then the track slots'
    src = src.repeat(len(dst))
    dst, nodes = torch.cat(dst), torch.cat(nodes)
    n = dst.shape[0]
    parents = blocks[3][0][src].to(torch.int64)  # [n, D]: the same in every layer
    on_path = inclusive_ancestor_mask(parents)[torch.arange(n, device=device), nodes.clamp(min=0)]
    on_path &= ((nodes >= 0) & (dst >= 0))[:, None]
    # parents precede children, so the ancestors in index order run root to leaf; accept_index
    # holds them as SGLang's flat positions row * D + node
    order = torch.where(on_path, torch.arange(D, device=device), D).sort(-1).values
    accept_index = torch.where(order < D, order + D * torch.arange(n, device=device)[:, None], -1)
    # the mixer's commit and the record blocks it reads (the first three of RecordLayout.views)
    commit, buffers = {"gdn": (gdn_pool_commit, GDNRecordBuffers),
                       "mamba2": (mamba2_pool_commit, Mamba2RecordBuffers)}[mixer]
    commit(temporal, dst, buffers(*blocks[:3]), src, accept_index, on_path.sum(-1), D)


class SpeclaGDNVerifyKernel(LinearAttnKernelBase):
    """A verify slot of SGLang's ``GDNKernelDispatcher`` (``tree_verify_kernel``, ``verify_kernel``):
    specla's verify where the pool holds factor records (trees, and the chains of SGLang's dummy
    runs, which come without ``retrieve_parent_token``), the kernel it replaces where the pool
    holds per-node states (a pool this plugin did not build). Decode and extend stay that kernel's.

    Args:
        sglang_kernel: the ``LinearAttnKernelBase`` SGLang put in the slot.
    """

    def __init__(self, sglang_kernel: LinearAttnKernelBase):
        self.sglang_kernel = sglang_kernel
        self.supports_strided_target_verify_qkv = sglang_kernel.supports_strided_target_verify_qkv

    def decode(self, *args, **kwargs):
        return self.sglang_kernel.decode(*args, **kwargs)

    def extend(self, *args, **kwargs):
        return self.sglang_kernel.extend(*args, **kwargs)

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                      intermediate_states_buffer, intermediate_state_indices, cache_steps,
                      retrieve_parent_token=None, **kwargs) -> Tensor:
        """``LinearAttnKernelBase.target_verify``: see :func:`verify_tree` (``intermediate_states_buffer``
        is ``records``, ``intermediate_state_indices`` is ``record_rows``)."""
        if not is_record_buffer(intermediate_states_buffer):
            return self.sglang_kernel.target_verify(
                A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                query_start_loc=query_start_loc, intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token, **kwargs)
        return verify_tree(A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                           query_start_loc=query_start_loc, records=intermediate_states_buffer,
                           record_rows=intermediate_state_indices, retrieve_parent_token=retrieve_parent_token,
                           cache_steps=cache_steps)
