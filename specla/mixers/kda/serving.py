"""specla's KDA verify and commit on a serving engine's own data (SGLang's, vLLM's): the recurrent
states stay in the engine's state pool, read and written in place by slot index in its layout
(``[slots, H, V, K]``, V before K, as both engines keep KDA's states); the tokens come packed
(``cu_seqlens``) with the raw gate inputs; a tree is one parent index per node; the factor
records go to engine-owned per-row buffers. No state is copied in or out.

- :func:`kda_pool_verify`: a drop-in for SGLang's KDA tree verify call,
  ``fused_sigmoid_gating_delta_rule_update(..., is_kda=True, disable_state_update=True,
  intermediate_states_buffer=..., retrieve_parent_token=...)`` (``TritonKDAKernel.target_verify``
  in ``srt/layers/attention/linear/kernels/kda_triton.py``): the same argument names for what both
  take, ``records`` in place of ``intermediate_states_buffer`` (a key, a delta and a per-channel
  decay per node and head instead of a full ``[H, V, K]`` state per node). The pool is not
  written.
- :func:`kda_pool_commit`: after acceptance, the accepted path of every row into its slot of the
  pool, from the engine's ``accept_index`` / ``accept_lens``, in closed form from the records.

Both run the kernels specla's own engine runs (:mod:`.verify`): for ``kda_pool_verify``, GLA's
decay kernel and the tree-masked verify for trees (two launches) and the state-resident serial
verify for chains (one); for ``kda_pool_commit``, the serial kernel's fused commit (one launch for
every layer). Kimi Linear's gate: ``g = -exp(A_log[h])
softplus(a + dt_bias[h, c])`` per key channel ``c``, ``beta = sigmoid(b)``; the safe gate
(SGLang's ``lower_bound``) is not taken.

Shapes: ``N`` rows (requests) of a batch, ``Ttot`` packed tokens, ``H`` heads (KDA's key and
value heads are one set), ``K``/``V`` head dims, ``R`` record rows, ``D`` record steps per row
(the most draft tokens a row verifies, root included; at most 64), ``slots`` state slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from torch import Tensor

from specla.ops.pending import commit_alone, pool_slots
from specla.ops.serving import check_commit, check_pool, check_records, check_rows, token_rows

from .verify import (
    MAX_TREE_NODES, SLOT_PARAMS, TUNING, _launch_serial, _launch_tree, _serial_verify_kernel, own_rows,
)


class KDARecordBuffers(NamedTuple):
    """Factor records, engine-owned, float32: row ``r`` holds the records of the request whose
    ``intermediate_state_indices`` entry is ``r``; step ``t`` is its ``t``-th verified token (0:
    the root, the token after the committed state). One layer's, contiguous (as
    :func:`kda_pool_verify` writes them), or every layer's with a leading ``[layers]`` dim of any
    stride, each layer's contiguous (as :func:`kda_pool_commit` may take them; :meth:`layer` is
    one layer's view). Allocate them once, e.g. with :func:`empty_record_buffers`.
    """

    k: Tensor  # [(layers,) R, D, H, K] L2-normalised keys
    delta: Tensor  # [(layers,) R, D, H, V] each node's delta on its own root path
    Gk: Tensor  # [(layers,) R, D, H, K] per-channel log decay summed along each node's root path

    def layer(self, i: int) -> "KDARecordBuffers":
        """Layer ``i``'s records (views) of every layer's."""
        return KDARecordBuffers(self.k[i], self.delta[i], self.Gk[i])


def empty_record_buffers(rows: int, steps: int, H: int, K: int, V: int, device: torch.device | str,
                         layers: tuple[int, ...] = ()) -> KDARecordBuffers:
    """Uninitialised :class:`KDARecordBuffers`, ``rows`` rows of ``steps`` steps (every layer's
    with ``layers = (L,)``)."""
    f = lambda *s: torch.empty(*layers, rows, steps, *s, dtype=torch.float32, device=device)  # noqa: E731
    return KDARecordBuffers(k=f(H, K), delta=f(H, V), Gk=f(H, K))


def _check_records(records: KDARecordBuffers, H: int, K: int, V: int, device, lead: tuple = ()) -> int:
    """KDA's record fields (:func:`specla.ops.serving.check_records`); returns ``D``."""
    return check_records(records, KDARecordBuffers, dict(k=(H, K), delta=(H, V), Gk=(H, K)), device, lead)


def _check_pool(state: Tensor, H: int, K: int, V: int, layers: bool = False) -> tuple[int, int, int, int]:
    """The pool's strides as the kernels take them, ``(slot, head, k, v)`` (ValueError unless a
    float32 ``[slots, H, V, K]``, or ``[layers, slots, H, V, K]`` where ``layers``)."""
    s = check_pool("initial_state_source", state, (H, V, K), "(V before K)", layers)
    return s[0], s[1], s[3], s[2]


def kda_pool_verify(
    A_log: Tensor, a: Tensor, dt_bias: Tensor, softplus_beta: float, softplus_threshold: float,
    q: Tensor, k: Tensor, v: Tensor, b: Tensor, initial_state_source: Tensor, initial_state_indices: Tensor,
    scale: float | None = None, use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None, *,
    records: KDARecordBuffers, intermediate_state_indices: Tensor, cache_steps: int | None = None,
    retrieve_parent_token: Tensor | None = None,
) -> Tensor:
    """Verify a batch of draft trees (or chains) of one KDA layer against the states in the
    engine's pool, and write each node's factor records; the pool is not written.

    Node ``t`` of row ``n`` is token ``cu_seqlens[n] + t``; node 0 (the root) hangs from the
    state in slot ``initial_state_indices[n]``, node ``t > 0`` from node
    ``retrieve_parent_token[n, t]`` (``< t``), or from node ``t - 1`` without
    ``retrieve_parent_token`` (chains). Every node's output is the serial KDA recurrence's along
    its root path from that state (:func:`specla.mixers.kda.reference.tree_kda`).

    Args:
        A_log: ``H`` elements (Kimi Linear's ``[1, 1, H, 1]`` or ``[H]``); dt_bias: ``H * K``
            elements (``[H * K]`` or ``[H, K]``), contiguous; a: ``[Ttot, H * K]`` (or ``[1,
            Ttot, H, K]``) and b: ``[Ttot, H]`` raw gate inputs, any float dtype, token rows may be
            strided: ``g = -exp(A_log) softplus(a + dt_bias)`` per key channel, ``beta =
            sigmoid(b)``, in float32 in the kernels.
        softplus_beta, softplus_threshold: must be ``1.0`` and ``20.0`` (PyTorch's softplus; what
            SGLang passes); ValueError otherwise.
        q, k: ``[1, Ttot, H, K]`` with ``cu_seqlens`` (or ``[N, T, H, K]`` without), float32 or
            bfloat16; token rows may be strided (slices of one projection), each row dense.
        v: ``[1, Ttot, H, V]`` (or ``[N, T, H, V]``), likewise.
        initial_state_source: ``[slots, H, V, K]`` float32 state pool (V before K; any strides,
            read from the tensor); read only.
        initial_state_indices: ``[N]`` int32/int64 slot per row; a negative slot reads a zero
            state (padding rows).
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k in the kernel (``x / sqrt(sum x^2 +
            1e-6)``), as SGLang's call does; else they come normalised.
        cu_seqlens: ``[N + 1]`` int32/int64 packed row starts (SGLang's ``query_start_loc``), or
            ``None``: ``N = q.shape[0]`` rows of ``T = q.shape[1]`` tokens.
        records: the layer's :class:`KDARecordBuffers` (``D`` steps a row): node ``t`` of row
            ``n`` is written to step ``t`` of row ``intermediate_state_indices[n]``; a negative
            row writes none, and its outputs are zero (a padding row: its decays have nowhere to
            go).
        intermediate_state_indices: ``[N]`` int32/int64 record row per row.
        cache_steps: the most tokens a row has (SGLang's ``draft_token_num``), ``<= D``; default
            ``D``. It sizes the kernels' tiles (no device sync reads ``cu_seqlens``).
        retrieve_parent_token: ``[N, >= cache_steps]`` int32/int64 parent of each node, local
            indices (entry 0 unread), or ``None`` for chains.
    Returns:
        ``o``: ``v``'s shape (``[1, Ttot, H, V]``), in ``q.dtype``.
    Raises:
        ValueError: shapes, dtypes or devices disagree, ``cache_steps > D``, or more than 64
        tokens a row (checked before any launch).
    """
    if (softplus_beta, softplus_threshold) != (1.0, 20.0):
        raise ValueError(f"the gates take softplus_beta 1.0 and softplus_threshold 20.0, got {softplus_beta}, "
                         f"{softplus_threshold}")
    H, K = k.shape[-2], k.shape[-1]
    V = v.shape[-1]
    dev = v.device
    if q.shape != k.shape or q.dim() != 4 or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tokens = q.shape[0] * q.shape[1]
    if a.numel() != tokens * H * K or b.numel() != tokens * H or a.shape[-1] not in (K, H * K) or b.shape[-1] != H:
        raise ValueError(f"a must be [tokens, {H * K}] and b [tokens, {H}] of the {tokens} tokens, got "
                         f"{list(a.shape)}, {list(b.shape)}")
    if A_log.numel() != H or dt_bias.numel() != H * K or not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError(f"A_log and dt_bias must be contiguous with {H} and {H * K} elements, got "
                         f"{list(A_log.shape)}, {list(dt_bias.shape)}")
    D = _check_records(records, H, K, V, dev)
    sS = _check_pool(initial_state_source, H, K, V)
    N, steps, parents = check_rows(D, cache_steps, MAX_TREE_NODES, tuple(q.shape), cu_seqlens, "initial_state_indices",
                                   initial_state_indices, intermediate_state_indices, retrieve_parent_token, dev)
    if len({x.device for x in (q, k, a, b, A_log, dt_bias, initial_state_source, *(
            y for y in (cu_seqlens, parents) if y is not None))} | {dev}) != 1:
        raise ValueError("all tensors must be on one device")
    qr, kr = token_rows(q, H, K), token_rows(k, H, K)
    if qr.stride(0) != kr.stride(0):  # one token stride for both
        qr, kr = qr.contiguous(), kr.contiguous()
    vr, ar, br = token_rows(v, H, V), token_rows(a, H * K), token_rows(b, H)
    o = torch.empty(v.shape, dtype=q.dtype, device=dev)
    out = (o, records.delta, records.Gk)
    slots = (initial_state_indices, intermediate_state_indices)
    where = dict(cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, rk=records.k,
                 scale=K**-0.5 if scale is None else scale, SQK=qr.stride(0), SV=vr.stride(0), SG=br.stride(0),
                 SGK=ar.stride(0), RAW_BETA=True, L2NORM=use_qk_l2norm_in_kernel)
    if parents is None:  # chains: the state-resident serial kernel, one token after another
        _launch_serial(N, q.shape[1] if cu_seqlens is None else steps, qr, kr, vr, ar, br, initial_state_source, out,
                       RD=D, **pool_slots(sS, *slots, **SLOT_PARAMS), **where)
    else:
        _launch_tree(N, steps, qr, kr, vr, ar, br, initial_state_source, out, state_strides=sS, T=q.shape[1],
                     parents=parents, sP=parents.stride(0), D=D, state_idx=slots[0], rec_idx=slots[1], **where)
    return o


def kda_pool_commit(
    initial_state_source: Tensor, initial_state_indices: Tensor, records: KDARecordBuffers,
    intermediate_state_indices: Tensor, accept_index: Tensor, accept_lens: Tensor, draft_token_num: int,
) -> None:
    """Commit each row's accepted path into its slot of the pool, in place, in closed form from
    the records of :func:`kda_pool_verify`: ``S = diag(exp(Gk_a)) S + sum_{j on the path}
    diag(exp(Gk_a - Gk_j)) k_j delta_j^T`` (``a`` the path's last node;
    :func:`specla.mixers.kda.reference.kda_commit_factor`). One launch, for one layer or for
    every layer at once.

    Args:
        initial_state_source: ``[slots, H, V, K]`` float32 pool, as :func:`kda_pool_verify`'s,
            or every layer's ``[layers, slots, H, V, K]`` (any strides); written in place (only
            the slots of rows with a path).
        initial_state_indices: ``[N]`` int32/int64 slot per row (negative: left alone); every
            layer's pool takes the same slots.
        records: as the verify of this step wrote them, one layer's or with a leading
            ``[layers]`` dim matching the pool's.
        intermediate_state_indices: ``[N]`` record row per row, as given to the verify.
        accept_index: ``[N, P]`` int32/int64, SGLang's: row ``n``'s accepted nodes root to leaf
            as flat positions ``n * draft_token_num + t`` (node ``t``), ``-1`` padded.
        accept_lens: ``[N]`` int32/int64 accepted nodes per row, the root included (``1``: the
            root alone; ``0`` leaves the slot untouched, not even written).
        draft_token_num: the stride of ``accept_index``'s positions (SGLang's tokens per row).
    Raises:
        ValueError: shapes, dtypes or devices disagree (checked before the launch).
    """
    st = initial_state_source
    layered = st.dim() == 5
    N = initial_state_indices.shape[0]
    H, K = records.k.shape[-2:]
    V = records.delta.shape[-1]
    sS = _check_pool(st, H, K, V, layers=layered)
    L = st.shape[0] if layered else 1
    D = _check_records(records, H, K, V, st.device, lead=(L,) if layered else ())
    check_commit(st, D, "initial_state_indices", initial_state_indices, intermediate_state_indices, accept_index,
                 accept_lens, draft_token_num)
    layer_strides = [x.stride(0) if layered else 0 for x in (st, *records)]
    BV = min(triton.next_power_of_2(V), TUNING["serial"]["BV"])
    commit_alone(
        _serial_verify_kernel, (N * H, triton.cdiv(V, BV), L), st, accept_lens, pk=records.k, pv=records.delta, pGk=records.Gk,
        path=accept_index.contiguous(), path_len=accept_lens, state_idx=initial_state_indices,
        rec_idx=intermediate_state_indices, P=accept_index.shape[1], Tp=D,
        sS_b=sS[0], sS_h=sS[1], sS_k=sS[2], sS_v=sS[3], path_step=draft_token_num,
        **dict(zip(("lS", "lk", "ld", "lG"), layer_strides)), H=H, K=K, V=V,
        BK=triton.next_power_of_2(K), BV=BV, **own_rows(H, K, V, 0), num_warps=TUNING["serial"]["num_warps"],
    )
