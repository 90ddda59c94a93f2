"""Triton twins of the draft-tree bookkeeping in :mod:`specla.drafters.pruning`: one launch per
draft level for the candidates' scores and the next frontier, and one for the final node
selection. In PyTorch a level's bookkeeping is a dozen launches (sum, casts, ``repeat_interleave``,
a top-k, floor division, three gathers) and the selection about twenty-five (two stable sorts, an
argsort, a scatter, gathers, masks); a recorded draft step at batch 1 is bound by the kernels it
launches (BENCHMARKS.md section 4). Each program takes one sequence and ranks its candidates by
pairwise comparison (a ``[C, C]`` tile), so the kernels take up to :data:`MAX_CANDIDATES`
candidates per sequence; the callers run the twins beyond.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out

MAX_CANDIDATES = 128  # candidates per sequence one program ranks (a [C, C] tile); more: the twins


@triton.jit
def _level_kernel(fscore, logp, child, ids, score_all, token_all, parent_all, nslot, ntok, nids, nscore,
                  off, C, M, KN, K: tl.constexpr, MKP: tl.constexpr, KNP: tl.constexpr,
                  LAST: tl.constexpr):
    """Sequence ``b``: candidates ``i = m * K + j`` of the ``M`` frontier nodes, score
    ``fscore[m] + logp[m, j]``, written with their tokens and parent ids at columns ``off + i`` of
    the tree's candidate rows; then (unless ``LAST``) the ``KN`` best (higher score first, lower
    index on ties) as the next frontier: producing slot, token, id ``off + i`` and score."""
    b = tl.program_id(0).to(tl.int64)
    MK = M * K
    i = tl.arange(0, MKP)
    live = i < MK
    m = i // K
    cand = tl.load(fscore + b * M + m, mask=live, other=0.0) + tl.load(logp + b * MK + i, mask=live, other=0.0)
    cand = tl.where(cand == cand, cand, float("-inf"))  # NaN ranks last (and ranks stay distinct)
    tok = tl.load(child + b * MK + i, mask=live, other=0)
    par = tl.load(ids + b * M + m, mask=live, other=0)
    tl.store(score_all + b * C + off + i, cand, mask=live)
    tl.store(token_all + b * C + off + i, tok, mask=live)
    tl.store(parent_all + b * C + off + i, par, mask=live)
    if not LAST:
        ci, cj = cand[:, None], cand[None, :]
        ii, jj = i[:, None], i[None, :]
        beats = ((cj > ci) | ((cj == ci) & (jj < ii))) & (jj < MK)
        rank = tl.sum(beats.to(tl.int32), axis=1)  # [MKP]: how many candidates come before i
        r = tl.arange(0, KNP)
        hit = (rank[None, :] == r[:, None]) & live[None, :]  # [KNP, MKP]: candidate i is r-th
        best = tl.sum(tl.where(hit, i[None, :], 0), axis=1)
        out = r < KN
        tl.store(nslot + b * KN + r, (best // K).to(tl.int64), mask=out)
        tl.store(ntok + b * KN + r, tl.load(child + b * MK + best, mask=out), mask=out)
        tl.store(nids + b * KN + r, (best + off).to(tl.int64), mask=out)
        tl.store(nscore + b * KN + r, tl.sum(tl.where(hit, cand[None, :], 0.0), axis=1), mask=out)


@triton.jit
def _select_kernel(score, token, parent, depth, tok_out, par_out, num_out, C, n, tau, CP: tl.constexpr):
    """Sequence ``b``: keep the candidates within ``tau`` of the best score, rank all by (kept
    score descending, depth, index), take the first ``n``; of those, the kept ones are the tree,
    placed by (depth, rank); parents remapped to their places (``-1``: the root); padding after
    ``num`` nodes is token 0, parent -1."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CP)
    live = i < C
    s = tl.load(score + b * C + i, mask=live, other=float("-inf"))
    s = tl.where(s == s, s, float("-inf"))  # NaN: as -inf, as in the twin
    d = tl.load(depth + i, mask=live, other=0)
    best = tl.max(s, axis=0)
    keep = (s >= best - tau) & live
    s = tl.where(keep, s, float("-inf"))
    si, sj = s[:, None], s[None, :]
    di, dj = d[:, None], d[None, :]
    ii, jj = i[:, None], i[None, :]
    before = (sj > si) | ((sj == si) & ((dj < di) | ((dj == di) & (jj < ii))))
    rank = tl.sum((before & (jj < C)).to(tl.int32), axis=1)
    sel = keep & (rank < n)
    ri, rj = rank[:, None], rank[None, :]
    ahead = sel[None, :] & ((dj < di) | ((dj == di) & (rj < ri)))
    place = tl.sum(ahead.to(tl.int32), axis=1)  # [CP]: a selected candidate's place in the tree
    p = tl.load(parent + b * C + i, mask=live, other=-1)
    is_parent = (jj == p[:, None]) & sel[None, :]
    par_place = tl.max(tl.where(is_parent, place[None, :], -1), axis=1)  # -1: the root
    tok = tl.load(token + b * C + i, mask=live, other=0)
    at = (place[None, :] == ii) & sel[None, :]  # [slot, candidate]: the candidate in that slot
    tl.store(tok_out + b * n + i, tl.sum(tl.where(at, tok[None, :], 0), axis=1), mask=i < n)
    tl.store(par_out + b * n + i, tl.max(tl.where(at, par_place[None, :], -1), axis=1).to(tl.int64), mask=i < n)
    tl.store(num_out + b, tl.sum(sel.to(tl.int64), axis=0))


def level(fscore: Tensor, logp: Tensor, child: Tensor, ids: Tensor, off: int, last: bool,
          score_all: Tensor, token_all: Tensor, parent_all: Tensor):
    """:func:`specla.drafters.pruning.next_frontier` in one launch, writing the level's
    candidates into the tree's candidate rows in place.

    Args:
        fscore: ``[B, M]`` float32 frontier path scores; logp: ``[B, M, k]`` float32 children's
            log-probabilities; child: ``[B, M, k]`` int64 their tokens; ids: ``[B, M]`` int64
            the frontier's candidate ids (-1: the root); all contiguous.
        off: candidates of the levels before (this level's first id and column); last: no next
            frontier.
        score_all, token_all, parent_all: ``[B, C]`` float32 / int64 / int64 contiguous
            candidate rows; columns ``off .. off + M * k`` are written.
    Returns:
        ``None`` when ``last``, else the next frontier ``(slot, tokens, ids, scores)``, each
        ``[B, min(k, M * k)]`` (slot: which frontier node produced it), best first.
    Raises:
        ValueError: more than :data:`MAX_CANDIDATES` candidates in the level, inputs or buffers
            of the wrong shape or dtype, or columns outside the buffers.
    """
    B, M, k = logp.shape
    MK, C = M * k, score_all.shape[1]
    if MK > MAX_CANDIDATES:
        raise ValueError(f"a level of {MK} candidates is more than the kernel's {MAX_CANDIDATES}")
    if (tuple(fscore.shape), tuple(ids.shape), tuple(child.shape)) != ((B, M), (B, M), (B, M, k)):
        raise ValueError(f"fscore and ids must be [B, M] = {[B, M]} and child [B, M, k] = {[B, M, k]}; got "
                         f"{list(fscore.shape)}, {list(ids.shape)}, {list(child.shape)}")
    if (logp.dtype, fscore.dtype, child.dtype, ids.dtype) != (torch.float32, torch.float32, torch.int64, torch.int64):
        raise ValueError("logp and fscore must be float32, child and ids int64")
    check_out((score_all, token_all, parent_all), (B, C), (torch.float32, torch.int64, torch.int64), logp.device)
    if off < 0 or off + MK > C:
        raise ValueError(f"columns {off}..{off + MK} do not fit {C} candidate columns")
    KN = min(k, MK)
    dev = logp.device
    nxt = (torch.empty(B, KN, dtype=torch.int64, device=dev), torch.empty(B, KN, dtype=torch.int64, device=dev),
           torch.empty(B, KN, dtype=torch.int64, device=dev), torch.empty(B, KN, dtype=torch.float32, device=dev))
    if B:
        _level_kernel[(B,)](fscore.contiguous(), logp.contiguous(), child.contiguous(), ids.contiguous(),
                            score_all, token_all, parent_all, *nxt, off, C, M, KN, K=k,
                            MKP=max(triton.next_power_of_2(MK), 2), KNP=triton.next_power_of_2(KN), LAST=last)
    return None if last else nxt


def select_nodes(score: Tensor, token: Tensor, parent: Tensor, depth: Tensor, budget: int,
                 tau: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`specla.drafters.pruning.select_nodes` with a fixed width, in one launch.

    Args:
        score: ``[B, C]`` float32 (NaN counts as ``-inf``); token, parent: ``[B, C]`` int64
            (parent: a candidate index below ``C``, or -1: the root; not checked, it would need
            a host read); depth: ``[C]`` int64, the same for every sequence.
        budget: ``N``; tau: the threshold in nats.
    Returns:
        ``(tokens, parents, num_nodes)``: ``[B, min(N, C)]`` int64 twice and ``[B]`` int64.
    Raises:
        ValueError: more than :data:`MAX_CANDIDATES` candidates, or shapes that do not match.
    """
    B, C = score.shape
    if C > MAX_CANDIDATES:
        raise ValueError(f"{C} candidates is more than the kernel's {MAX_CANDIDATES}")
    if tuple(token.shape) != (B, C) or tuple(parent.shape) != (B, C) or tuple(depth.shape) != (C,):
        raise ValueError(f"token and parent must be [B, C] = {[B, C]} and depth [C]; got {list(token.shape)}, "
                         f"{list(parent.shape)}, {list(depth.shape)}")
    n, dev = min(budget, C), score.device
    tok = torch.empty(B, n, dtype=torch.int64, device=dev)
    par = torch.empty(B, n, dtype=torch.int64, device=dev)
    num = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        _select_kernel[(B,)](score.contiguous(), token.contiguous(), parent.contiguous(), depth.contiguous(),
                             tok, par, num, C, n, float(tau), CP=max(triton.next_power_of_2(C), 2), num_warps=8)
    return tok, par, num
