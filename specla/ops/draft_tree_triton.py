"""Triton twins of the draft-tree bookkeeping in :mod:`specla.drafters.pruning`: one launch per
draft level for the candidates' scores and the next frontier (:func:`level`; :func:`topk_level`
also takes the level's top-k children from the drafter's logits in that launch), and one for the
final node selection. In PyTorch a level's bookkeeping is a dozen launches (sum, casts, ``repeat_interleave``,
a top-k, floor division, three gathers) and the selection about twenty-five (two stable sorts, an
argsort, a scatter, gathers, masks); a recorded draft step at batch 1 is bound by the kernels it
launches (BENCHMARKS.md section 4). One program per sequence ranks its candidates by
pairwise comparison (a ``[C, C]`` tile), so the kernels take up to :data:`MAX_CANDIDATES`
candidates per sequence; the callers run the twins beyond. :func:`pair_rows` gathers a level's
inputs from its parents' rows (a gather and a concatenation in PyTorch), :func:`accepted_rows` the
accepted path's pairs and new feature after verify (two concatenations, a clamp, three gathers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out, topk_triton

MAX_CANDIDATES = 128  # candidates per sequence one program ranks (a [C, C] tile); more: the twins


@triton.jit
def _level_rows(cand, tok, par, i, live, b, score_all, token_all, parent_all, nslot, ntok, nids, nscore, off, C, KN,
                K: tl.constexpr, KNP: tl.constexpr, LAST: tl.constexpr):
    """Sequence ``b``'s level from its candidates laid out flat (``live`` marks the real ones;
    ``i`` is candidate ``m * K + j``'s index, ``cand``, ``tok``, ``par`` its path score, token and
    parent id): each written at column ``off + i`` of the tree's candidate rows; then (unless
    ``LAST``) the ``KN`` best (higher score first, lower index on ties) as the next frontier:
    producing slot, token, id ``off + i`` and score."""
    cand = tl.where(cand == cand, cand, float("-inf"))  # NaN ranks last (and ranks stay distinct)
    tl.store(score_all + b * C + off + i, cand, mask=live)
    tl.store(token_all + b * C + off + i, tok, mask=live)
    tl.store(parent_all + b * C + off + i, par, mask=live)
    if not LAST:
        ci, cj = cand[:, None], cand[None, :]
        ii, ij = i[:, None], i[None, :]
        beats = ((cj > ci) | ((cj == ci) & (ij < ii))) & live[None, :]
        rank = tl.sum(beats.to(tl.int32), axis=1)  # how many candidates come before each one
        r = tl.arange(0, KNP)
        hit = (rank[None, :] == r[:, None]) & live[None, :]  # [KNP, n]: candidate f is r-th
        best = tl.sum(tl.where(hit, i[None, :], 0), axis=1)
        out = r < KN
        tl.store(nslot + b * KN + r, (best // K).to(tl.int64), mask=out)
        tl.store(ntok + b * KN + r, tl.sum(tl.where(hit, tok[None, :], 0), axis=1), mask=out)
        tl.store(nids + b * KN + r, (best + off).to(tl.int64), mask=out)
        tl.store(nscore + b * KN + r, tl.sum(tl.where(hit, cand[None, :], 0.0), axis=1), mask=out)


@triton.jit
def _level_kernel(fscore, logp, child, ids, score_all, token_all, parent_all, nslot, ntok, nids, nscore,
                  off, C, M, KN, K: tl.constexpr, MKP: tl.constexpr, KNP: tl.constexpr,
                  LAST: tl.constexpr, ROOT: tl.constexpr):
    """Sequence ``b``: candidates ``i = m * K + j`` of the ``M`` frontier nodes, score
    ``fscore[m] + logp[m, j]``, through :func:`_level_rows`. ``ROOT``: the frontier is the root
    (score 0, id -1); ``fscore`` and ``ids`` are not read."""
    b = tl.program_id(0).to(tl.int64)
    MK = M * K
    i = tl.arange(0, MKP)
    live = i < MK
    m = i // K
    cand = tl.load(logp + b * MK + i, mask=live, other=0.0)
    if not ROOT:
        cand += tl.load(fscore + b * M + m, mask=live, other=0.0)
    tok = tl.load(child + b * MK + i, mask=live, other=0)
    if ROOT:
        par = tl.full([MKP], -1, tl.int64)
    else:
        par = tl.load(ids + b * M + m, mask=live, other=0)
    _level_rows(cand, tok, par, i, live, b, score_all, token_all, parent_all, nslot, ntok, nids, nscore, off, C, KN,
                K, KNP, LAST)


@triton.jit
def _topk_level_kernel(x, pv, pi, pm, ps, counter, fscore, ids, score_all, token_all, parent_all, nslot, ntok, nids,
                       nscore, off, C, M, V, S, sx, KN, K: tl.constexpr, MP: tl.constexpr, KP: tl.constexpr,
                       BV: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, KNP: tl.constexpr, LAST: tl.constexpr,
                       ROOT: tl.constexpr, F64: tl.constexpr):
    """Program ``(r, s)``: block ``s`` of logit row ``r = b * M + m``
    (:func:`specla.ops.topk_triton.block_rows`); the last of sequence ``b``'s ``M * S`` programs
    to finish (``counter[b]``, which it sets back to 0) merges the sequence's rows
    (:func:`topk_triton.merge_rows`) and runs :func:`_level_rows` on them, candidate ``i = m * K
    + j`` at flat position ``m * KP + j`` of the ``[MP, KP]`` tiles. The partials are released
    (every thread's stores, a CTA barrier, then the counter's acq_rel add at GPU scope) before
    the last program acquires and reads them: the last-block reduction of CUDA's
    threadFenceReduction sample."""
    r, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    topk_triton.block_rows(x, pv, pi, pm, ps, r, s, V, S, sx, K, KP, BV, F64)
    tl.debug_barrier()
    b = r // M
    if tl.atomic_add(counter + b, 1, sem="acq_rel", scope="gpu") == M * S - 1:
        mm = tl.arange(0, MP)
        live_m = mm < M
        lp, tok = topk_triton.merge_rows(pv, pi, pm, ps, b * M + mm, live_m, S, K, MP, KP, BS, BC, F64)
        cand = lp.to(tl.float32)  # the level's scores are float32, as level() takes them
        if ROOT:
            par = tl.full([MP, KP], -1, tl.int64)
        else:
            cand += tl.load(fscore + b * M + mm, mask=live_m, other=0.0)[:, None]
            par = tl.zeros([MP, KP], tl.int64) + tl.load(ids + b * M + mm, mask=live_m, other=0)[:, None]
        f = tl.arange(0, MP * KP)
        fm, fj = f // KP, f % KP
        _level_rows(tl.reshape(cand, [MP * KP]), tl.reshape(tok, [MP * KP]), tl.reshape(par, [MP * KP]),
                    fm * K + fj, (fm < M) & (fj < K), b, score_all, token_all, parent_all, nslot, ntok, nids, nscore,
                    off, C, KN, K, KNP, LAST)
        tl.store(counter + b, 0)  # ready for the next level (every other program of b has counted)


@triton.jit
def _select_kernel(score, token, parent, depth, tok_out, par_out, num_out, place_buf, C, n, tau,
                   CP: tl.constexpr):
    """Sequence ``b``: keep the candidates within ``tau`` of the best score, rank all by (kept
    score descending, depth, index), take the first ``n``; of those, the kept ones are the tree,
    placed by (depth, rank); parents remapped to their places (``-1``: the root); padding after
    ``num`` nodes is token 0, parent -1. Two ``[CP, CP]`` comparison tiles (rank, place) in
    int32; the outputs are scattered to their places and the parents' places read back through
    ``place_buf`` (``[B, CP]`` int32 scratch), so no tile is spent on gathers."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CP)
    live = i < C
    s = tl.load(score + b * C + i, mask=live, other=float("-inf"))
    s = tl.where(s == s, s, float("-inf"))  # NaN: as -inf, as in the twin
    d = tl.load(depth + i, mask=live, other=0).to(tl.int32)
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
    num = tl.sum(sel.to(tl.int32), axis=0)
    tl.store(place_buf + b * CP + i, tl.where(sel, place, -1))  # an unselected parent: the root's -1
    tl.debug_barrier()  # the places are read back by other threads of this program
    p = tl.load(parent + b * C + i, mask=sel, other=-1)
    par_place = tl.load(place_buf + b * CP + p, mask=sel & (p >= 0), other=-1)
    tok = tl.load(token + b * C + i, mask=sel, other=0)
    pad = (i >= num) & (i < n)  # the slots no candidate takes (disjoint from the places written)
    tl.store(tok_out + b * n + i, tl.zeros_like(tok), mask=pad)
    tl.store(par_out + b * n + i, tl.full([CP], -1, tl.int64), mask=pad)
    tl.store(tok_out + b * n + place, tok, mask=sel)
    tl.store(par_out + b * n + place, par_place.to(tl.int64), mask=sel)
    tl.store(num_out + b, num.to(tl.int64))


# P and M follow the prompt length in a drafter's reset: not specialised on (Triton specialises
# integers on == 1 and % 16), so a new length never compiles a kernel inside a call
@triton.jit(do_not_specialize=["P", "M"])
def _pair_rows_kernel(feats, slot, emb, tokens, out, P, M, H, HAS_SLOT: tl.constexpr, HAS_TOK: tl.constexpr,
                      BH: tl.constexpr):
    """Row ``(b, m)``: ``[feats[b, slot[b, m]] ; emb[b, m]]`` (row ``m`` without ``HAS_SLOT``;
    with ``HAS_TOK`` the embedding is row ``tokens[b, m]`` of the table ``emb``)."""
    i = tl.program_id(0).to(tl.int64)
    b, m = i // M, i % M
    if HAS_SLOT:
        r = tl.load(slot + i)
    else:
        r = m
    if HAS_TOK:
        e = tl.load(tokens + i)
    else:
        e = i
    for start in range(0, H, BH):
        c = start + tl.arange(0, BH)
        ok = c < H
        tl.store(out + i * 2 * H + c, tl.load(feats + (b * P + r) * H + c, mask=ok), mask=ok)
        tl.store(out + i * 2 * H + H + c, tl.load(emb + e * H + c, mask=ok), mask=ok)


def pair_rows(feats: Tensor, slot: Tensor | None, emb: Tensor, out: Tensor | None = None,
              tokens: Tensor | None = None) -> Tensor:
    """:func:`specla.drafters.pruning.pair_rows` in one launch: a draft level's pairs (parent
    feature, token embedding) gathered and concatenated.

    Args:
        feats: ``[B, P, H]`` the previous level's features; slot: ``[B, M]`` int64 rows below
            ``P`` (not checked: a host read), or ``None`` (``P == M``); emb: ``[B, M, H]`` in
            ``feats``' dtype, or with ``tokens`` the embedding table ``[vocab, H]`` whose rows
            ``tokens [B, M]`` (int64 below ``vocab``, not checked) select; out: an optional
            preallocated result.
    Returns:
        ``[B, M, 2H]`` contiguous.
    Raises:
        ValueError: shapes or dtypes that do not match, or ``out`` of another layout.
    """
    B, P, H = feats.shape if feats.dim() == 3 else (0, 0, -1)
    if tokens is not None:
        M = tokens.shape[-1] if tokens.dim() else -1
        e_ok = (tokens.dim() == 2 and tokens.shape[0] == B and tokens.dtype == torch.int64 and emb.dim() == 2
                and emb.shape[1] == H)
    else:
        M = emb.shape[1] if emb.dim() == 3 else -1
        e_ok = tuple(emb.shape) == (B, M, H)
    if (not e_ok or feats.dtype != emb.dtype or (slot is None and P != M)
            or (slot is not None and (tuple(slot.shape) != (B, M) or slot.dtype != torch.int64))):
        raise ValueError(f"pair_rows: feats {list(feats.shape)} {feats.dtype}, emb {list(emb.shape)} {emb.dtype}, "
                         f"tokens {None if tokens is None else (list(tokens.shape), tokens.dtype)}, "
                         f"slot {None if slot is None else (list(slot.shape), slot.dtype)}: expected [B, P, H] and "
                         "[B, M, H] of one dtype (or a [vocab, H] table with int64 [B, M] tokens), int64 [B, M] "
                         "slots (or None with P == M)")
    if out is None:
        out = torch.empty(B, M, 2 * H, dtype=emb.dtype, device=emb.device)
    check_out((out,), (B, M, 2 * H), (emb.dtype,), emb.device)
    if B * M:
        _pair_rows_kernel[(B * M,)](feats.contiguous(), emb if slot is None else slot.contiguous(), emb.contiguous(),
                                    emb if tokens is None else tokens.contiguous(), out, P, M, H,
                                    HAS_SLOT=slot is not None, HAS_TOK=tokens is not None,
                                    BH=min(triton.next_power_of_2(H), 1024))
    return out


def level(fscore: Tensor | None, logp: Tensor, child: Tensor, ids: Tensor | None, off: int, last: bool,
          score_all: Tensor, token_all: Tensor, parent_all: Tensor):
    """:func:`specla.drafters.pruning.next_frontier` in one launch, writing the level's
    candidates into the tree's candidate rows in place.

    Args:
        fscore: ``[B, M]`` float32 frontier path scores; logp: ``[B, M, k]`` float32 children's
            log-probabilities; child: ``[B, M, k]`` int64 their tokens; ids: ``[B, M]`` int64
            the frontier's candidate ids (-1: the root); all contiguous. ``fscore`` and ``ids``
            both ``None``: the frontier is the root (``M == 1``, score 0, id -1), with no
            tensors made for it.
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
    if tuple(child.shape) != (B, M, k):
        raise ValueError(f"child must be [B, M, k] = {[B, M, k]}, got {list(child.shape)}")
    if (logp.dtype, child.dtype) != (torch.float32, torch.int64):
        raise ValueError("logp and fscore must be float32, child and ids int64")
    root, nxt = _level_frontier(fscore, ids, B, M, k, off, score_all, token_all, parent_all, logp.device)
    if B:
        _level_kernel[(B,)](logp if root else fscore.contiguous(), logp.contiguous(), child.contiguous(),
                            child if root else ids.contiguous(), score_all, token_all, parent_all, *nxt, off,
                            score_all.shape[1], M, nxt[0].shape[1], K=k, MKP=max(triton.next_power_of_2(M * k), 2),
                            KNP=triton.next_power_of_2(nxt[0].shape[1]), LAST=last, ROOT=root)
    return None if last else nxt


def _level_frontier(fscore: Tensor | None, ids: Tensor | None, B: int, M: int, k: int, off: int, score_all: Tensor,
                    token_all: Tensor, parent_all: Tensor, dev: torch.device) -> tuple[bool, tuple[Tensor, ...]]:
    """The checks a level's launch needs (see :func:`level`'s errors) and its next frontier's
    buffers: ``(root, (slot, tokens, ids, scores))``, each ``[B, min(k, M * k)]``."""
    MK, C = M * k, score_all.shape[1]
    if MK > MAX_CANDIDATES:
        raise ValueError(f"a level of {MK} candidates is more than the kernel's {MAX_CANDIDATES}")
    root = fscore is None and ids is None
    if root and M != 1:
        raise ValueError(f"the root's level has one frontier node, got M = {M}")
    if not root and (fscore is None or ids is None or tuple(fscore.shape) != (B, M) or tuple(ids.shape) != (B, M)):
        raise ValueError(f"fscore and ids must be [B, M] = {[B, M]} (or both None at the root); got "
                         f"{None if fscore is None else list(fscore.shape)}, {None if ids is None else list(ids.shape)}")
    if not root and (fscore.dtype, ids.dtype) != (torch.float32, torch.int64):
        raise ValueError("logp and fscore must be float32, child and ids int64")
    check_out((score_all, token_all, parent_all), (B, C), (torch.float32, torch.int64, torch.int64), dev)
    if off < 0 or off + MK > C:
        raise ValueError(f"columns {off}..{off + MK} do not fit {C} candidate columns")
    KN = min(k, MK)
    return root, (torch.empty(B, KN, dtype=torch.int64, device=dev), torch.empty(B, KN, dtype=torch.int64, device=dev),
                  torch.empty(B, KN, dtype=torch.int64, device=dev), torch.empty(B, KN, dtype=torch.float32, device=dev))


class LevelCounter:
    """The per-sequence count of a draft level's finished programs (:func:`topk_level`): zeros
    when made, and every launch that takes it leaves it zeroed, so the levels of one tree share
    one (one fill per tree rather than one per level). Two launches that may run at the same time
    (on two streams) must not share one.

    Args:
        batch: ``B``, the sequences of the levels it serves; device: their logits' device.
    Attributes:
        counts: ``[B]`` int32 on ``device``, zero between launches.
    """

    def __init__(self, batch: int, device: torch.device | str):
        self.counts = torch.zeros(batch, dtype=torch.int32, device=device)


def topk_level(fscore: Tensor | None, logits: Tensor, ids: Tensor | None, k: int, off: int, last: bool,
               score_all: Tensor, token_all: Tensor, parent_all: Tensor, counter: LevelCounter | None = None):
    """A draft level from the drafter's logits: each frontier node's top-``k`` children by
    log-probability (:func:`specla.ops.topk.log_softmax_topk`) and :func:`level` on them, in one
    launch where the two functions take three: one program per node and block of
    :data:`specla.ops.topk_triton.BLOCK` logits, the last of each sequence's programs merging its
    nodes' blocks and doing the level's bookkeeping. ``k`` above
    :data:`specla.ops.topk_triton.MAX_K`: those two functions.

    Args:
        fscore, ids: as in :func:`level` (both ``None``: the roots' level); logits: ``[B, M, V]``
            float32, bfloat16, float16 or float64; ``k``: ``1 <= k <= V``; off, last, score_all,
            token_all, parent_all: as in :func:`level`.
        counter: a :class:`LevelCounter` of ``B`` sequences on the logits' device, which the
            launch counts its finished programs in (a tree's levels share one); ``None``: a new
            one.
    Returns:
        :func:`level`'s next frontier, or ``None`` when ``last``.
    Raises:
        ValueError: as :func:`level` and :func:`specla.ops.topk_triton.log_softmax_topk` do;
            logits that are not ``[B, M, V]`` floats; a ``counter`` that is not a
            :class:`LevelCounter` of ``B`` sequences on the logits' device.
    """
    if logits.dim() != 3 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be [B, M, V] floats, got {list(logits.shape)} {logits.dtype}")
    B, M, V = logits.shape
    if k > topk_triton.MAX_K or not 1 <= k <= V:
        logp, child = topk_triton.log_softmax_topk(logits, k)
        return level(fscore, logp.float(), child, ids, off, last, score_all, token_all, parent_all)
    root, nxt = _level_frontier(fscore, ids, B, M, k, off, score_all, token_all, parent_all, logits.device)
    if counter is None:
        counter = LevelCounter(B, logits.device)
    if not isinstance(counter, LevelCounter) or counter.counts.shape != (B,) or counter.counts.device != logits.device:
        got = (f"a LevelCounter of {counter.counts.shape[0]} on {counter.counts.device}"
               if isinstance(counter, LevelCounter) else type(counter).__name__)
        raise ValueError(f"counter must be a LevelCounter of B = {B} sequences on {logits.device}; got {got}")
    if B:
        rows, pv, pi, pm, ps = topk_triton.partials(logits, k)
        S, KN = pm.shape[1], nxt[0].shape[1]
        _topk_level_kernel[(B * M, S)](rows, pv, pi, pm, ps, counter.counts, pm if root else fscore.contiguous(),
                                       pi if root else ids.contiguous(), score_all, token_all, parent_all, *nxt,
                                       off, score_all.shape[1], M, V, S, rows.stride(0), KN, K=k,
                                       MP=max(triton.next_power_of_2(M), 2), KP=max(triton.next_power_of_2(k), 2),
                                       BV=topk_triton.BLOCK, BS=triton.next_power_of_2(S),
                                       BC=triton.next_power_of_2(S * k), KNP=triton.next_power_of_2(KN), LAST=last,
                                       ROOT=root, F64=pm.dtype == torch.float64)
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
    CP = max(triton.next_power_of_2(C), 2)
    if B:
        _select_kernel[(B,)](score.contiguous(), token.contiguous(), parent.contiguous(), depth.contiguous(),
                             tok, par, num, torch.empty(B, CP, dtype=torch.int32, device=dev), C, n, float(tau),
                             CP=CP, num_warps=4)
    return tok, par, num


@triton.jit
def _accepted_rows_kernel(feature, hidden, path, num_acc, root, tokens, feats, toks, last, T, W, H,
                          BH: tl.constexpr):
    """Program ``(b, j)``: pair ``j < W`` (feature and token) or, for ``j == W``, the feature at
    the path's end."""
    b, j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    if j == W:
        node = tl.load(path + b * W + tl.load(num_acc + b))
        src = hidden + (b * T + node) * H
        dst = last + b * H
    elif j == 0:
        src = feature + b * H
        dst = feats + b * W * H
        tl.store(toks + b * W, tl.load(root + b))
    else:
        node = tl.maximum(tl.load(path + b * W + j - 1), 0)
        src = hidden + (b * T + node) * H
        dst = feats + (b * W + j) * H
        tl.store(toks + b * W + j, tl.maximum(tl.load(tokens + b * (W - 1) + j - 1), 0))
    for start in range(0, H, BH):
        c = start + tl.arange(0, BH)
        ok = c < H
        tl.store(dst + c, tl.load(src + c, mask=ok), mask=ok)


def accepted_rows(feature: Tensor, hidden: Tensor, path: Tensor, num_accepted: Tensor, root: Tensor,
                  tokens: Tensor, out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`specla.drafters.pruning.accepted_rows` in one launch (same arguments and results;
    ``out``: optional preallocated results, contiguous).

    Raises:
        ValueError: shapes, dtypes or devices that do not match, or ``out`` of another layout
            (``num_accepted`` is not checked against ``D``: a host read).
    """
    B, T, H = hidden.shape
    W = tokens.shape[1] + 1 if tokens.dim() == 2 else -1
    ints = (path, num_accepted, root, tokens)
    if (feature.shape != (B, H) or feature.dtype != hidden.dtype or path.shape != (B, W)
            or num_accepted.shape != (B,) or root.shape != (B,) or tokens.shape != (B, W - 1)
            or any(x.dtype != torch.int64 or x.device != hidden.device for x in ints)
            or feature.device != hidden.device):
        raise ValueError(f"accepted_rows: feature {list(feature.shape)} {feature.dtype}, hidden {list(hidden.shape)} "
                         f"{hidden.dtype}, path/num_accepted/root/tokens {[(list(x.shape), x.dtype) for x in ints]}: "
                         "expected [B, H] and [B, T, H] of one dtype, int64 [B, D + 1], [B], [B] and [B, D] "
                         "on one device")
    if out is None:
        out = (torch.empty(B, W, H, dtype=hidden.dtype, device=hidden.device),
               torch.empty(B, W, dtype=torch.int64, device=hidden.device),
               torch.empty(B, H, dtype=hidden.dtype, device=hidden.device))
    check_out(out[:1], (B, W, H), (hidden.dtype,), hidden.device)
    check_out(out[1:2], (B, W), (torch.int64,), hidden.device)
    check_out(out[2:], (B, H), (hidden.dtype,), hidden.device)
    feats, toks, last = out
    if B:
        _accepted_rows_kernel[(B, W + 1)](feature.contiguous(), hidden.contiguous(), path.contiguous(),
                                          num_accepted.contiguous(), root.contiguous(), tokens.contiguous(),
                                          feats, toks, last, T, W, H, BH=min(triton.next_power_of_2(H), 1024))
    return feats, toks, last
