"""specla's Mamba2 (SSD) verify and commit on a serving engine's own data (SGLang's, vLLM's): the
recurrent states stay in the engine's state pool, read and written in place by slot index in its
layout (``[slots, H, P, N]``: head dim before state size); the tokens come packed
(``cu_seqlens``) or ``[N, T]`` with the raw step sizes; a tree is one parent index per node; the
factor records go to engine-owned per-row buffers. No state is copied in or out.

- :func:`mamba2_pool_verify`: a drop-in for SGLang's tree verify call, ``selective_state_update(
  ..., disable_state_update=True, intermediate_states_buffer=..., retrieve_parent_token=...)``
  (``MambaMixer2.forward`` in ``srt/layers/attention/mamba/mamba.py`` under ``is_target_verify``):
  the same argument names for what both take, ``records`` in place of
  ``intermediate_states_buffer`` (a ``B``, a ``u = dt x`` and a decay per node instead of a full
  ``[H, P, N]`` state per node). The state pool is not written. vLLM's packed decode rows
  (``cu_seqlens = query_start_loc_d``) are taken too.
- :func:`mamba2_pool_commit`: after acceptance, the accepted path of every row into its slot of
  the pool, from the engine's ``accept_index`` / ``accept_lens``, in closed form from the records.

Both run the kernels specla's own engine runs (:mod:`.verify`), one launch each: for
:func:`mamba2_pool_verify`, the tree-masked factorized verify for trees and the state-resident
serial verify for chains; for :func:`mamba2_pool_commit`, the serial kernel's fused commit (one
launch for every layer).

Shapes: ``N`` rows (requests) of a batch, ``Ttot`` tokens, ``H`` heads, ``P`` head dim, ``NG``
groups of ``B``/``C`` (head ``h`` reads group ``h // (H / NG)``), ``Ns`` state size, ``R``
record rows, ``D`` record steps per row (the most tokens a row verifies, root included; at most
64), ``slots`` state slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from torch import Tensor

from specla.ops.pending import commit_alone, pool_slots
from specla.ops.serving import check_commit, check_pool, check_records, check_rows, token_rows

from .verify import MAX_TREE_NODES, SLOT_PARAMS, _launch_serial, _launch_tree, _serial_verify_kernel, own_rows


class Mamba2RecordBuffers(NamedTuple):
    """Factor records, engine-owned, float32: row ``r`` holds the records of the request whose
    ``intermediate_state_indices`` entry is ``r``; step ``t`` is its ``t``-th verified token (0:
    the root, the token after the committed state). One layer's, contiguous (as
    :func:`mamba2_pool_verify` writes them), or every layer's with a leading ``[layers]`` dim of
    any stride, each layer's contiguous (as :func:`mamba2_pool_commit` may take them;
    :meth:`layer` is one layer's view). Allocate them once (CUDA graphs, preemption and
    prefix-cache donation see them), e.g. with :func:`empty_record_buffers`.
    """

    Bm: Tensor  # [(layers,) R, D, NG, Ns] the SSM input matrix B of each node
    u: Tensor  # [(layers,) R, D, H, P] dt * x of each node
    G: Tensor  # [(layers,) R, D, H] log decay dt * A summed along each node's root path

    def layer(self, i: int) -> "Mamba2RecordBuffers":
        """Layer ``i``'s records (views) of every layer's."""
        return Mamba2RecordBuffers(self.Bm[i], self.u[i], self.G[i])


def empty_record_buffers(rows: int, steps: int, H: int, P: int, NG: int, Ns: int,
                         device: torch.device | str) -> Mamba2RecordBuffers:
    """Uninitialised :class:`Mamba2RecordBuffers` of one layer, ``rows`` rows of ``steps`` steps."""
    f = lambda *s: torch.empty(rows, steps, *s, dtype=torch.float32, device=device)  # noqa: E731
    return Mamba2RecordBuffers(Bm=f(NG, Ns), u=f(H, P), G=f(H))


def _check_records(records: Mamba2RecordBuffers, H: int, P: int, NG: int, Ns: int, device,
                   lead: tuple = ()) -> int:
    """Mamba2's record fields (:func:`specla.ops.serving.check_records`); returns ``D``."""
    return check_records(records, Mamba2RecordBuffers, dict(Bm=(NG, Ns), u=(H, P), G=(H,)), device, lead)


def _check_pool(state: Tensor, H: int, P: int, Ns: int, layers: bool = False) -> tuple[int, int, int, int]:
    """The pool's strides as the kernels take them, ``(slot, head, n, p)`` (ValueError unless a
    float32 ``[slots, H, P, Ns]``, or ``[layers, slots, H, P, Ns]`` where ``layers``)."""
    s = check_pool("state", state, (H, P, Ns), "(P before N)", layers)
    return s[0], s[1], s[3], s[2]


def _per_head(name: str, t: Tensor, *tied: int) -> Tensor:
    """``t`` as one value per head ``[H]`` (or token and head): given so, or the engines' expand
    of it over the ``tied`` trailing dims (stride 0, as both engines pass ``A``, ``dt``,
    ``dt_bias`` and ``D``). ValueError where those dims are not tied."""
    if t.dim() < 1 + len(tied) or tuple(t.shape[t.dim() - len(tied):]) != tied or \
            any(s != 0 for s in t.stride()[t.dim() - len(tied):]):
        raise ValueError(f"{name} must be one value per head, or its expand over {list(tied)} (stride 0), got "
                         f"{list(t.shape)} of strides {list(t.stride())}")
    return t[(...,) + (0,) * len(tied)]


def mamba2_pool_verify(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
    dt_softplus: bool, state_batch_indices: Tensor, cu_seqlens: Tensor | None = None, out: Tensor | None = None, *,
    records: Mamba2RecordBuffers, intermediate_state_indices: Tensor, cache_steps: int | None = None,
    retrieve_parent_token: Tensor | None = None,
) -> Tensor:
    """Verify a batch of draft trees (or chains) of one Mamba2 layer against the states in the
    engine's pool, and write each node's factor records; the pool is not written.

    Node ``t`` of row ``n`` is token ``cu_seqlens[n] + t`` (or ``x[n, t]``); node 0 (the root)
    hangs from the state in slot ``state_batch_indices[n]``, node ``t > 0`` from node
    ``retrieve_parent_token[n, t]`` (``< t``), or from node ``t - 1`` without
    ``retrieve_parent_token`` (chains). Every node's output is the serial SSD recurrence's along
    its root path from that state: ``S <- exp(dt A) S + dt B x^T``, ``y = C^T S + D x``, with
    ``dt = softplus(dt_raw + dt_bias)`` in float32 (no clamp: the engines' decode kernels apply
    none). There is no ``z``: both engines gate in the norm after the mixer.

    Args:
        state: ``[slots, H, P, Ns]`` float32 state pool (any strides); read only.
        x: ``[N, T, H, P]`` (SGLang's), or ``[Ttot, H, P]`` with ``cu_seqlens`` (vLLM's), float32
            or bfloat16; token rows may be strided (slices of one projection), each row dense.
        dt: the raw step sizes, ``x``'s token dims then ``[H]``, or SGLang's and vLLM's expand
            over ``P`` (``[..., H, P]``, stride 0); any float dtype; token rows may be strided.
        A: ``[H]`` (negative: ``-exp(A_log)``), or the engines' ``[H, P, Ns]`` expand (stride 0).
        B, C: ``x``'s token dims then ``[NG, Ns]``; token rows may be strided (one stride for
            both), each row dense.
        D: ``[H]``, its ``[H, P]`` expand (stride 0), or ``[H, P]`` skip weights.
        dt_bias: ``[H]`` or its ``[H, P]`` expand (stride 0).
        dt_softplus: must be ``True`` (what both engines pass); ValueError otherwise.
        state_batch_indices: ``[N]`` int32/int64 slot per row; a negative slot reads a zero state
            (padding rows).
        cu_seqlens: ``[N + 1]`` int32/int64 packed row starts, or ``None``: ``N = x.shape[0]``
            rows of ``T = x.shape[1]`` tokens.
        out: optional output of ``x``'s shape, any float dtype, token rows may be strided (each
            row dense), written in place (SGLang's ``out``); default a new one in ``x.dtype``.
        records: the layer's :class:`Mamba2RecordBuffers` (``D`` steps a row): node ``t`` of row
            ``n`` is written to step ``t`` of row ``intermediate_state_indices[n]``; a negative
            row writes none.
        intermediate_state_indices: ``[N]`` int32/int64 record row per row.
        cache_steps: the most tokens a row has (SGLang's ``draft_token_num``), ``<= D``; default
            ``D``. It sizes the kernel's tiles (no device sync reads ``cu_seqlens``).
        retrieve_parent_token: ``[N, >= cache_steps]`` int32/int64 parent of each node, local
            indices (entry 0 unread), or ``None`` for chains.
    Returns:
        ``y``: ``out``, or a new tensor of ``x``'s shape in ``x.dtype``.
    Raises:
        ValueError: shapes, dtypes or devices disagree, ``cache_steps > D``, or more than 64
        tokens a row (checked before any launch).
    """
    if dt_softplus is not True:
        raise ValueError(f"the step sizes take softplus (dt_softplus=True), got dt_softplus={dt_softplus}")
    if x.dim() != (4 if cu_seqlens is None else 3):
        raise ValueError(f"x must be [N, T, H, P] without cu_seqlens and [Ttot, H, P] with, got {list(x.shape)}")
    H, P = x.shape[-2:]
    NG, Ns = B.shape[-2:]
    lead = tuple(x.shape[:-2])
    dev = x.device
    if tuple(B.shape) != (*lead, NG, Ns) or C.shape != B.shape or H % NG:
        raise ValueError(f"B, C must be [{', '.join(map(str, lead))}, NG, Ns] with {H} % NG == 0, got "
                         f"{list(B.shape)}, {list(C.shape)}")
    if dt.shape == x.shape:
        dt = _per_head("dt", dt, P)
    if tuple(dt.shape) != (*lead, H):
        raise ValueError(f"dt must be [{', '.join(map(str, lead))}, {H}] or its expand over P, got {list(dt.shape)}")
    A = (_per_head("A", A, P, Ns) if A.dim() == 3 else A).contiguous()
    dt_bias = (_per_head("dt_bias", dt_bias, P) if dt_bias.dim() == 2 else dt_bias).contiguous()
    D = _per_head("D", D, P) if D.dim() == 2 and D.stride(-1) == 0 else D.contiguous()
    if A.shape != (H,) or dt_bias.shape != (H,) or tuple(D.shape) not in ((H,), (H, P)):
        raise ValueError(f"A and dt_bias must be [{H}] and D [{H}] or [{H}, {P}] (or the engines' expands), got "
                         f"{list(A.shape)}, {list(dt_bias.shape)}, {list(D.shape)}")
    Dsteps = _check_records(records, H, P, NG, Ns, dev)
    sS = _check_pool(state, H, P, Ns)
    N, steps, parents = check_rows(Dsteps, cache_steps, MAX_TREE_NODES, tuple(x.shape), cu_seqlens,
                                   "state_batch_indices", state_batch_indices, intermediate_state_indices,
                                   retrieve_parent_token, dev)
    if out is not None and (out.shape != x.shape or not out.is_floating_point()):
        raise ValueError(f"out must be a float tensor of x's shape {list(x.shape)}, got {out.dtype} {list(out.shape)}")
    if len({t.device for t in (x, dt, A, B, C, D, dt_bias, state, *(
            t for t in (cu_seqlens, parents, out) if t is not None))} | {dev}) != 1:
        raise ValueError("all tensors must be on one device")
    y = torch.empty(x.shape, dtype=x.dtype, device=dev) if out is None else out
    yr = token_rows(y, H, P)
    if yr.data_ptr() != y.data_ptr():  # a copy: out's rows are not dense
        raise ValueError(f"out's token rows must each be dense [{H}, {P}], got strides {list(out.stride())}")
    xr, dtr = token_rows(x, H, P), token_rows(dt, H)
    Br, Cr = token_rows(B, NG, Ns), token_rows(C, NG, Ns)
    if Br.stride(0) != Cr.stride(0):  # one token stride for both
        Br, Cr = Br.contiguous(), Cr.contiguous()
    slots = (state_batch_indices, intermediate_state_indices)
    where = dict(A=A, dt_bias=dt_bias, rB=records.Bm, cu_seqlens=cu_seqlens, SX=xr.stride(0), SDT=dtr.stride(0),
                 SBC=Br.stride(0), SY=yr.stride(0), RD=Dsteps)
    out3 = (yr, records.u, records.G)
    if parents is None:  # chains: the state-resident serial kernel, one token after another
        _launch_serial(N, x.shape[1] if cu_seqlens is None else steps, xr, dtr, Br, Cr, D, state, out3,
                       **pool_slots(sS, *slots, **SLOT_PARAMS), **where)
    else:
        _launch_tree(N, steps, xr, dtr, Br, Cr, D, state, out3, state_strides=sS, parents=parents,
                     sP=parents.stride(0), T=x.shape[1] if cu_seqlens is None else 0, state_idx=slots[0],
                     rec_idx=slots[1], **where)
    return y


def mamba2_pool_commit(
    state: Tensor, state_batch_indices: Tensor, records: Mamba2RecordBuffers, intermediate_state_indices: Tensor,
    accept_index: Tensor, accept_lens: Tensor, draft_token_num: int,
) -> None:
    """Commit each row's accepted path into its slot of the pool, in place, in closed form from
    the records of :func:`mamba2_pool_verify`: ``S = exp(G_a) S + sum_{j on the path} exp(G_a -
    G_j) B_j u_j^T`` (``a`` the path's last node; docs/DESIGN.md section 5), stored as the pool's
    ``[P, Ns]``. One launch, for one layer or for every layer at once.

    Args:
        state: ``[slots, H, P, Ns]`` float32 pool, as :func:`mamba2_pool_verify`'s, or every
            layer's ``[layers, slots, H, P, Ns]`` (any strides); written in place (only the slots
            of rows with a path).
        state_batch_indices: ``[N]`` int32/int64 slot per row (negative: left alone); every
            layer's pool takes the same slots.
        records: as the verify of this step wrote them, one layer's or with a leading
            ``[layers]`` dim matching the pool's.
        intermediate_state_indices: ``[N]`` record row per row, as given to the verify.
        accept_index: ``[N, L]`` int32/int64, SGLang's: row ``n``'s accepted nodes root to leaf
            as flat positions ``n * draft_token_num + t`` (node ``t``), ``-1`` padded.
        accept_lens: ``[N]`` int32/int64 accepted nodes per row, the root included (``1``: the
            root alone; ``0`` leaves the slot untouched, not even written).
        draft_token_num: the stride of ``accept_index``'s positions (SGLang's tokens per row).
    Raises:
        ValueError: shapes, dtypes or devices disagree (checked before the launch).
    """
    layered = state.dim() == 5
    NG, Ns = records.Bm.shape[-2:]
    H, P = records.u.shape[-2:]
    sS = _check_pool(state, H, P, Ns, layers=layered)
    L = state.shape[0] if layered else 1
    Dsteps = _check_records(records, H, P, NG, Ns, state.device, lead=(L,) if layered else ())
    check_commit(state, Dsteps, "state_batch_indices", state_batch_indices, intermediate_state_indices, accept_index,
                 accept_lens, draft_token_num)
    layer_strides = [t.stride(0) if layered else 0 for t in (state, *records)]
    BP = min(triton.next_power_of_2(P), 64)
    commit_alone(
        _serial_verify_kernel, (state_batch_indices.shape[0] * H, triton.cdiv(P, BP), L), state, accept_lens,
        pB=records.Bm, pu=records.u, pG=records.G, path=accept_index.contiguous(),
        path_len=accept_lens, state_idx=state_batch_indices, rec_idx=intermediate_state_indices,
        Lp=accept_index.shape[1], Tp=Dsteps, sS_b=sS[0], sS_h=sS[1], sS_n=sS[2], sS_p=sS[3],
        path_step=draft_token_num, **dict(zip(("lS", "lB", "lu", "lG"), layer_strides)), H=H, NG=NG, N=Ns, P=P,
        BN=triton.next_power_of_2(Ns), BP=BP, D_HDIM=False, **own_rows(H, P, NG, Ns, 0),
    )
