"""Triton twin of :mod:`specla.ops.topk`: the top-``k`` log-probabilities of logit rows in two
launches. In a recorded draft level PyTorch spends about twenty on it: a cast, the log-softmax,
and ``torch.topk``, whose multi-block radix select over a vocabulary-wide float32 row takes three
kernels per radix pass over four passes, then scans, counts, a fill and the gather (the ``mbtopk``
kernels in BENCHMARKS.md section 5's profile); a recorded step is bound by the kernels it
launches. Each program of the first launch takes one block of one row: its
maximum, its sum of ``exp(x - max)`` and its ``k`` best entries; the second merges a row's blocks
(the log-sum-exp of the blocks, then the ``k`` best of their candidates). Entries are ranked by
logit, equal logits by the smaller token id, as in the twin. A NaN logit counts as ``-inf`` here
(the twin's stable sort ranks it first and its log-softmax makes the row NaN, which the draft tree
scores as ``-inf``): either way every id returned is a real token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out
from .norm import compute_dtype

BLOCK = 1024  # vocabulary entries per program of the first launch
MAX_K = 16  # larger k: the twin (the loops below unroll k times)
_NONE = tl.constexpr(2**31 - 1)  # the id of "no entry" (a block with fewer than k entries); a
# Triton kernel reads a global only as a constexpr


@triton.jit
def block_rows(x, pv, pi, pm, ps, r, s, V, S, sx, K: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
               F64: tl.constexpr):
    """Row ``r``, block ``s``: ``pm, ps [r, s]`` the block's max and sum of ``exp(x - max)``,
    ``pv, pi [r, s, :K]`` its ``K`` largest entries and their ids (largest first, smaller id first
    on ties; ``-inf`` and ``_NONE`` past the block's entries). Called from this module's block
    kernel and from the draft level's (:mod:`specla.ops.draft_tree_triton`)."""
    ct = tl.float64 if F64 else tl.float32
    pos = tl.arange(0, BV)
    alive = s * BV + pos < V
    v = tl.load(x + r * sx + s * BV + pos, mask=alive, other=float("-inf")).to(ct)
    v = tl.where(v == v, v, float("-inf"))  # NaN as -inf: a block of NaN still names real entries
    mx = tl.max(v, axis=0)
    tl.store(pm + r * S + s, mx)
    shift = tl.where(mx > float("-inf"), mx, 0.0)  # a block of only -inf entries sums to 0, not nan
    tl.store(ps + r * S + s, tl.sum(tl.exp(v - shift), axis=0))
    kk = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), ct)
    ids = tl.full([KP], _NONE, tl.int32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(alive, v, float("-inf")), axis=0)
        p = tl.min(tl.where(alive & (v == best), pos, BV), axis=0)  # the first position holding it
        found = p < BV
        vals = tl.where(kk == j, tl.where(found, best, float("-inf")), vals)
        ids = tl.where(kk == j, tl.where(found, s * BV + p, _NONE), ids)
        alive = alive & (pos != p)
    out = (r * S + s) * K + kk
    tl.store(pv + out, vals, mask=kk < K)
    tl.store(pi + out, ids, mask=kk < K)


@triton.jit
def _block_topk_kernel(x, pv, pi, pm, ps, V, S, sx, K: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                       F64: tl.constexpr):
    """Row ``program_id(0)``, block ``program_id(1)``: :func:`block_rows`."""
    block_rows(x, pv, pi, pm, ps, tl.program_id(0).to(tl.int64), tl.program_id(1), V, S, sx, K, KP, BV, F64)


@triton.jit
def merge_rows(pv, pi, pm, ps, row, live, S, K: tl.constexpr, MP: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr,
               BC: tl.constexpr, F64: tl.constexpr):
    """Rows ``row [MP]`` of the block partials (``live [MP]``: which are real): each row's
    log-sum-exp of its ``S`` blocks, then its ``K`` best candidates of the ``S * K`` (largest
    first, smallest id on ties). Returns ``(log-probabilities [MP, KP]`` in the compute dtype,
    ``ids [MP, KP]`` int64``)``, columns ``>= K`` and dead rows unspecified. Called from this
    module's merge kernel and from the draft level's (:mod:`specla.ops.draft_tree_triton`), where
    other programs of the same launch wrote the partials: they are read from L2 (``.cg``), never
    from a stale L1 line."""
    ct = tl.float64 if F64 else tl.float32
    so = tl.arange(0, BS)
    bm = live[:, None] & (so[None, :] < S)
    m = tl.load(pm + row[:, None] * S + so[None, :], mask=bm, other=float("-inf"), cache_modifier=".cg")
    big = tl.max(m, axis=1)
    shift = tl.where(big > float("-inf"), big, 0.0)
    # log-probability = (x - shift) - log(sum exp(x - shift)): the shift first, as log_softmax does
    # (x - (shift + log sum) cancels two large numbers when the logits are large)
    sums = tl.load(ps + row[:, None] * S + so[None, :], mask=bm, other=0.0, cache_modifier=".cg")
    log_sum = tl.log(tl.sum(sums * tl.exp(m - shift[:, None]), axis=1))
    co = tl.arange(0, BC)
    alive = live[:, None] & (co[None, :] < S * K)
    at = row[:, None] * S * K + co[None, :]
    v = tl.load(pv + at, mask=alive, other=float("-inf"), cache_modifier=".cg").to(ct)
    ids = tl.load(pi + at, mask=alive, other=_NONE, cache_modifier=".cg")
    kk = tl.arange(0, KP)
    lp = tl.full([MP, KP], float("-inf"), ct)
    tok = tl.zeros([MP, KP], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(tl.where(alive, v, float("-inf")), axis=1)
        tied = alive & (v == best[:, None])
        tid = tl.min(tl.where(tied, ids, _NONE), axis=1)
        p = tl.min(tl.where(tied & (ids == tid[:, None]), co[None, :], BC), axis=1)
        lp = tl.where(kk[None, :] == j, ((best - shift) - log_sum)[:, None], lp)
        tok = tl.where(kk[None, :] == j, tid[:, None].to(tl.int64), tok)
        alive = alive & (co[None, :] != p[:, None])
    return lp, tok


MERGE_ROWS = 2  # rows per program of the merge kernel (a tile needs at least two)


@triton.jit
def _merge_topk_kernel(pv, pi, pm, ps, ov, oi, R, S, K: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr,
                       BC: tl.constexpr, F64: tl.constexpr, MP: tl.constexpr):
    """Rows ``MP * pid ..`` (:func:`merge_rows`), written as log-probabilities ``ov`` and ids
    ``oi`` ``[R, K]``."""
    row = tl.program_id(0).to(tl.int64) * MP + tl.arange(0, MP)
    live = row < R
    lp, tok = merge_rows(pv, pi, pm, ps, row, live, S, K, MP, KP, BS, BC, F64)
    kk = tl.arange(0, KP)
    at = row[:, None] * K + kk[None, :]
    ok = live[:, None] & (kk[None, :] < K)
    tl.store(ov + at, lp, mask=ok)
    tl.store(oi + at, tok, mask=ok)


def log_softmax_topk(logits: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """:func:`specla.ops.topk.log_softmax_topk` in two launches (the twin for ``k > MAX_K``).

    Args:
        logits: ``[..., V]`` float32, bfloat16, float16 or float64 (the last dim is made dense
            if it is not); k: ``1 <= k <= V``.
        out: optional preallocated ``(values, ids)``: contiguous, of the result's shapes and
            dtypes, on the logits' device.
    Returns:
        ``(values [..., k]`` float32 log-probabilities (float64 for float64 logits),
        ``ids [..., k]`` int64), largest logit first, smaller id first on equal logits.
    Raises:
        ValueError: ``k`` outside ``1..V``; ``out`` not contiguous tensors of those shapes and
            dtypes.
    """
    V = logits.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"k must be in 1..{V} (the vocabulary), got {k}")
    ct = compute_dtype(logits)
    if out is not None:
        check_out(out, (*logits.shape[:-1], k), (ct, torch.int64), logits.device)
    if k > MAX_K:
        from .topk import log_softmax_topk as twin

        values, ids = twin(logits, k)
        if out is not None:
            out[0].copy_(values)
            out[1].copy_(ids)
            return out
        return values, ids
    values, ids = out if out is not None else (
        torch.empty(*logits.shape[:-1], k, dtype=ct, device=logits.device),
        torch.empty(*logits.shape[:-1], k, dtype=torch.int64, device=logits.device))
    if values.numel():
        pv, pi, pm, ps = block_topk(logits, k)
        R, S = pm.shape
        _merge_topk_kernel[(triton.cdiv(R, MERGE_ROWS),)](
            pv, pi, pm, ps, values, ids, R, S, K=k, KP=max(triton.next_power_of_2(k), 2), BS=triton.next_power_of_2(S),
            BC=triton.next_power_of_2(S * k), F64=ct == torch.float64, MP=MERGE_ROWS)
    return values, ids


def block_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The first of :func:`log_softmax_topk`'s launches (one program per row and block of
    ``BLOCK`` entries): each block's ``k`` largest logits, their ids, its maximum and its sum of
    ``exp(x - max)``, for that function's merge launch (the draft level's
    :func:`specla.ops.draft_tree_triton.topk_level` runs :func:`block_rows` inside its own launch).

    Args:
        logits: ``[..., V]`` float32, bfloat16, float16 or float64, ``R`` rows in all (the last
            dim made dense if it is not); k: ``1 <= k <= min(V, MAX_K)`` (not checked here).
    Returns:
        ``(pv [R, S, k]`` in the compute dtype, ``pi [R, S, k]`` int32 ids (``2**31 - 1`` past a
        block's entries), ``pm [R, S]`` block maxima, ``ps [R, S]`` block sums), ``S =
        ceil(V / BLOCK)``.
    """
    rows, pv, pi, pm, ps = partials(logits, k)
    R, S = pm.shape
    if R:
        _block_topk_kernel[(R, S)](rows, pv, pi, pm, ps, rows.shape[1], S, rows.stride(0), K=k,
                                   KP=triton.next_power_of_2(k), BV=BLOCK, F64=pm.dtype == torch.float64)
    return pv, pi, pm, ps


def partials(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``logits`` as ``R`` rows ``[R, V]`` with a dense last dim (a copy only if it is not), and
    :func:`block_topk`'s four results unwritten (``torch.empty``: no launch)."""
    V = logits.shape[-1]
    rows = logits.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R, S, ct, dev = rows.shape[0], triton.cdiv(V, BLOCK), compute_dtype(logits), logits.device
    return (rows, torch.empty(R, S, k, dtype=ct, device=dev), torch.empty(R, S, k, dtype=torch.int32, device=dev),
            torch.empty(R, S, dtype=ct, device=dev), torch.empty(R, S, dtype=ct, device=dev))
