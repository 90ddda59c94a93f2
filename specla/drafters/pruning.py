"""Draft-tree construction with confidence-guided pruning (SpecLA section 6.3, after EAGLE-2).

Expansion is level-synchronous so that one drafter call serves a whole tree level of every
sequence: at depth ``d`` the ``top_k`` best nodes of depth ``d`` (by path score) are expanded,
each proposing its ``top_k`` most likely children. The path score of a node is the sum of the
drafter's log-probabilities along its root path, ``q(v) = sum log p_draft``. After ``D`` levels,
a node is kept only if ``q(v) >= q* - tau_tree`` (``q*`` the best score of the tree; checked
before the budget), then the ``N`` best kept nodes form the tree. Scores never increase along a
path, so the best ``N`` (ties broken by depth) are ancestor-closed. ``top_k = 1`` gives a chain.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..config import SpecConfig
from ..ops import kernels
from ..ops.topk import log_softmax_topk
from ..tree import DraftTree

tree_kernels = kernels("specla.ops.draft_tree_triton")
topk_kernels = kernels("specla.ops.topk_triton")

# expand(state, slot [B, M] | None, tokens [B, M]) -> (state, logits [B, M, vocab]): the
# drafter's step for M frontier nodes per sequence, node m hanging from row slot[b, m] of the
# state the previous call returned (None: the first call, on the root state, M = 1); the
# returned state is the M nodes', the logits score their children (the tree takes each node's
# top_k by log-probability, log_softmax_topk). The drafter gathers its own state (its layout is
# its own: a kernel may read the parents' rows directly).
ExpandFn = Callable[[object, Tensor | None, Tensor], tuple[object, Tensor]]


def build_tree(expand: ExpandFn, root_state: Tensor, roots: Tensor, config: SpecConfig,
               fixed_width: bool = False, kernels: bool = False) -> DraftTree:
    """Best-first, confidence-pruned draft tree for a batch.

    Args:
        expand: the drafter step (see ``ExpandFn``); called ``D`` times with ``M <= top_k``.
        root_state: the drafter state the roots are read with, passed to the first ``expand``
            call as it is (for the EAGLE drafter: the target feature at the last accepted node).
        roots: ``[B]`` int64, the roots' tokens (the last committed tokens).
        config: ``num_draft_tokens`` (N), ``max_depth`` (D), ``top_k``, ``tau_tree`` (nats).
        fixed_width: pad every tree to ``N`` columns (no host read of the widest tree: what a
            CUDA graph needs); else the width is that of the widest tree.
        kernels: each level's top-k and bookkeeping in one Triton launch (and one fill per
            tree for its programs' counter) and the selection in one
            (:mod:`specla.ops.draft_tree_triton`, the same tree) up to its
            ``MAX_CANDIDATES``; else the PyTorch forms below.
    Returns:
        a :class:`DraftTree` on ``roots.device`` with at most ``N`` nodes per sequence, nodes in
        depth order (so parents come first).
    """
    N, k = config.num_draft_tokens, config.top_k
    D = min(config.max_depth, N)
    B, dev = roots.shape[0], roots.device
    if N == 0:
        return DraftTree.empty(B, dev)
    state, slot, toks = root_state, None, roots[:, None]  # frontier: its parents' rows and tokens [B, M]
    # node ids (-1: the root) and path scores of the frontier; the level kernel takes the root's as given
    ids = fscore = None
    scores, tokens, parents, sizes = [], [], [], []
    rows = None  # with the kernels: the candidate rows (score, token, parent), written in place
    count = 0
    for d in range(1, D + 1):
        state, logits = expand(state, slot, toks)
        M, k = logits.shape[1], min(k, logits.shape[2])  # k < top_k when the vocabulary is smaller
        if d == 1 and kernels:
            widths = [min(k, k ** j) * k for j in range(D)]  # candidates per level
            if sum(widths) <= tree_kernels.MAX_CANDIDATES:
                rows = (torch.empty(B, sum(widths), dtype=torch.float32, device=dev),
                        torch.empty(B, sum(widths), dtype=torch.int64, device=dev),
                        torch.empty(B, sum(widths), dtype=torch.int64, device=dev))
                counter = tree_kernels.LevelCounter(B, dev)  # one zero fill for the tree's levels
        if rows is not None:
            nxt = tree_kernels.topk_level(fscore, logits, ids, k, count, d == D, *rows, counter=counter)
        else:
            # trees over the level kernel's candidates keep the Triton top-k with the PyTorch bookkeeping
            logp, child = (topk_kernels.log_softmax_topk if kernels else log_softmax_topk)(logits, k)
            if ids is None:
                ids = torch.full((B, 1), -1, dtype=torch.int64, device=dev)
                fscore = torch.zeros(B, 1, device=dev, dtype=torch.float32)
            cand, child_ids, nxt = next_frontier(fscore, logp, child, ids, count, d == D)
            scores.append(cand)
            tokens.append(child.flatten(1))
            parents.append(child_ids)
        sizes.append(M * k)
        count += M * k
        if nxt is None:
            break
        slot, toks, ids, fscore = nxt
    depth = _level_depths(tuple(sizes), dev)
    if rows is not None:
        tok, par, num = tree_kernels.select_nodes(*rows, depth, N, config.tau_tree)
        width = tok.shape[1] if fixed_width else (int(num.max()) if B else 0)
        return DraftTree.trusted(tok[:, :width].contiguous(), par[:, :width].contiguous(), num)
    score, token, parent = (torch.cat(x, 1) for x in (scores, tokens, parents))
    return select_nodes(score, token, parent, depth.expand(B, -1), N, config.tau_tree, fixed_width)


def next_frontier(fscore: Tensor, logp: Tensor, child: Tensor, ids: Tensor, first_id: int,
                  last: bool) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor, Tensor] | None]:
    """One level of :func:`build_tree`: its candidates and the next frontier.

    Args:
        fscore: ``[B, M]`` float32 path scores of the frontier; logp: ``[B, M, k]`` the
            children's log-probabilities; child: ``[B, M, k]`` int64 their tokens; ids: ``[B, M]``
            int64 the frontier's candidate ids (-1: the root).
        first_id: the id of this level's first candidate (the candidates of the levels before).
        last: the last level (no next frontier).
    Returns:
        ``(scores [B, M * k]`` float32 ``fscore + logp`` (NaN as ``-inf``: the candidate
        ranks last), ``parents [B, M * k]`` int64 (the producing node's id), ``frontier)``;
        ``frontier`` is ``None`` when ``last``, else
        ``(slot, tokens, ids, scores)``, each ``[B, min(k, M * k)]``: the best candidates
        (higher score first, lower index on ties), the frontier node that produced each, and
        their ids ``first_id + index``.
    """
    M, k = logp.shape[1], logp.shape[2]
    cand = (fscore[..., None] + logp.float()).flatten(1)  # [B, M * k]
    cand = cand.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    parents = ids.repeat_interleave(k, dim=1)
    if last:
        return cand, parents, None
    best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, : min(k, M * k)]
    return cand, parents, (best // k, child.flatten(1).gather(1, best), best + first_id, cand.gather(1, best))


_DEPTHS: dict[tuple, Tensor] = {}


def _level_depths(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """``[C]`` int64 depth of every candidate of levels of ``sizes`` candidates (1 for the first),
    made once per shape and device: a constant, so a recorded step launches nothing for it (the
    first call is never the recorded one: a graph is recorded after a warm-up step)."""
    key = (sizes, str(device))
    if key not in _DEPTHS:
        _DEPTHS[key] = torch.cat([torch.full((n,), d, dtype=torch.int64) for d, n in enumerate(sizes, 1)]).to(device)
    return _DEPTHS[key]


def select_nodes(score: Tensor, token: Tensor, parent: Tensor, depth: Tensor, budget: int, tau: float,
                 fixed_width: bool = False) -> DraftTree:
    """The draft tree of the ``budget`` best candidates within ``tau`` of each sequence's best,
    in depth order, computed with tensor operations only (no per-sequence host loop: on a GPU
    that loop cost one synchronisation per node).

    Args:
        score: ``[B, C]`` float32 path scores of the candidates (NaN counts as ``-inf``);
            token: ``[B, C]`` int64;
            parent: ``[B, C]`` int64 candidate index of the parent (``-1``: the root);
            depth: ``[B, C]`` int64, ``>= 1``. Scores never increase along a path.
        budget: ``N``, the most nodes per sequence; tau: the threshold in nats.
        fixed_width: return ``min(budget, C)`` columns instead of the widest tree's width (which
            is read on the host).
    Returns:
        a :class:`DraftTree` on ``score.device`` (padding: token 0, parent -1), built without the
        host-side checks (:meth:`DraftTree.trusted`): the structure holds by construction.
    """
    B, C = score.shape
    score = score.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)  # NaN (overflow) ranks last
    keep = score >= score.max(1, keepdim=True).values - tau
    order = sorted_nodes(torch.where(keep, score, float("-inf")), depth)[:, :budget]  # kept ones first
    valid = keep.gather(1, order)
    n = order.shape[1]
    # topological order: by depth, then by rank; unkept slots sort last
    rank = torch.arange(n, device=score.device).expand(B, n)
    key = torch.where(valid, depth.gather(1, order) * (n + 1) + rank, (C + 2) * (n + 1))
    topo = key.argsort(dim=1)
    chosen, valid = order.gather(1, topo), valid.gather(1, topo)
    pos = torch.full((B, C), -1, dtype=torch.int64, device=score.device)
    pos.scatter_(1, chosen, torch.where(valid, rank, -1))
    par = parent.gather(1, chosen)
    par = torch.where((par >= 0) & valid, pos.gather(1, par.clamp(min=0)), -1)
    num = valid.sum(1)
    width = n if fixed_width else (int(num.max()) if B else 0)
    tok = torch.where(valid, token.gather(1, chosen), 0)
    return DraftTree.trusted(tok[:, :width].contiguous(), par[:, :width].contiguous(), num)


def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b, j]]`` for every ``b, j``: ``[B, M, ...]`` by ``[B, n]`` int64 -> ``[B, n, ...]``."""
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def pair_rows(feats: Tensor, slot: Tensor | None, emb: Tensor, tokens: Tensor | None = None) -> Tensor:
    """``[feats[b, slot[b, m]] ; emb[b, m]]``: a draft level's pairs of parent feature ``[B, P,
    H]`` (row ``slot [B, M]`` int64, or row ``m`` when ``None``) and token embedding ``[B, M,
    H]`` (with ``tokens [B, M]`` int64: rows ``tokens`` of the embedding table ``emb [vocab,
    H]``), as ``[B, M, 2H]`` (EAGLE's drafter input). Twin of
    :func:`specla.ops.draft_tree_triton.pair_rows`."""
    if tokens is not None:
        emb = emb[tokens]
    return torch.cat([feats if slot is None else take_rows(feats, slot), emb], -1)


def accepted_rows(feature: Tensor, hidden: Tensor, path: Tensor, num_accepted: Tensor, root: Tensor,
                  tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs a step's accepted path adds to a feature drafter's cache, and its new feature.
    Twin of :func:`specla.ops.draft_tree_triton.accepted_rows`.

    Pair ``0`` is the root token with the feature it was drafted from; pair ``j >= 1`` is the
    ``j``-th accepted token with the feature verify computed at its parent (path node ``j - 1``).

    Args:
        feature: ``[B, H]`` the feature the step's tree was drafted from; hidden: ``[B, T, H]``
            verify's last-layer features (root-explicit: node 0 is the root), same dtype.
        path: ``[B, D + 1]`` int64 accepted nodes from the root, ``-1`` padding (read as node
            0); num_accepted: ``[B]`` int64 in ``0..D``; root: ``[B]`` int64 the step's roots;
            tokens: ``[B, D]`` int64 accepted tokens, ``-1`` padding (read as token 0).
    Returns:
        ``(feats [B, D + 1, H], toks [B, D + 1]`` int64, ``last [B, H])``: the pairs (those
        past ``num_accepted`` are padding the caller leaves outside the cache's length) and
        the feature at the path's end, ``hidden[b, path[b, num_accepted[b]]]``.
    """
    B, W = tokens.shape[0], tokens.shape[1] + 1
    rows = torch.arange(B, device=hidden.device)
    feats = torch.cat([feature[:, None], hidden[rows[:, None], path[:, : W - 1].clamp(min=0)]], 1)
    toks = torch.cat([root[:, None], tokens.clamp(min=0)], 1)
    return feats, toks, hidden[rows, path.gather(1, num_accepted[:, None])[:, 0]]


def sorted_nodes(score: Tensor, depth: Tensor) -> Tensor:
    """Node indices ``[B, M]`` by decreasing score, shallower first on ties (stable)."""
    by_depth = torch.argsort(depth, dim=1, stable=True)
    by_score = torch.argsort(score.gather(1, by_depth), dim=1, descending=True, stable=True)
    return by_depth.gather(1, by_score)


# step(state, slot [B, M] | None, tokens [B, M]) -> (state, q [B, M, vocab]): the drafter's step
# for M frontier nodes (as ExpandFn), returning its sampling distribution at each.
SampleStepFn = Callable[[object, Tensor | None, Tensor], tuple[object, Tensor]]


def sample_tree(step: SampleStepFn, root_state: Tensor, roots: Tensor, config: SpecConfig,
                generator: torch.Generator | None = None) -> DraftTree:
    """A draft tree whose tokens are *sampled* from the drafter, with their distributions, for
    lossless recursive rejection sampling with the drafter's ``q`` (SpecInfer's multi-draft
    speculative sampling, Miao et al. 2024).

    Level-synchronous like :func:`build_tree`, but the shape never depends on a node's own
    sampled token, which the acceptance rule needs (siblings must be independent draws from
    their parent's ``q``): at depth ``d`` the frontier nodes, best path score first, get ``top_k``
    children each, drawn independently (with replacement) from their ``q``, until the level's
    share ``ceil(N / D)`` or the budget ``N`` runs out (so the tree reaches depth ``D``); every
    drawn node is kept. The next frontier is the ``top_k`` best children
    of the level (their own tokens decide only whether *they* are expanded, not whether they
    exist). ``tau_tree`` does not apply (pruning a node by its own score would bias the draws).

    Args:
        step: the drafter step (see ``SampleStepFn``).
        root_state: the drafter state at the roots (the first ``step`` call's); roots: ``[B]`` int64.
        config: ``num_draft_tokens`` (N), ``max_depth`` (D), ``top_k``.
        generator: the random source of the draws.
    Returns:
        a :class:`DraftTree` on ``roots.device`` with the same number of nodes (at most ``N``)
        in every sequence, in depth order, and ``draft_probs`` ``[B, n, vocab]`` float32.
    """
    N, k = config.num_draft_tokens, config.top_k
    D = min(config.max_depth, N)
    B, dev = roots.shape[0], roots.device
    if N == 0:
        return DraftTree.empty(B, dev)
    per_level = -(-N // D)
    state, frontier, toks = root_state, None, roots[:, None]
    ids = torch.full((B, 1), -1, dtype=torch.int64, device=dev)
    fscore = torch.zeros(B, 1, device=dev, dtype=torch.float32)
    tokens, parents, probs = [], [], []
    count = 0
    for _ in range(D):
        state, q = step(state, frontier, toks)
        q, M = q.float(), q.shape[1]
        # the best frontier nodes come first, so they get children first; a level takes at most
        # ceil(N / D) nodes so that the tree reaches depth D (all N at depth 1 or 2 would cap
        # the accepted length there)
        width = min(M * k, N - count, per_level)
        child = torch.multinomial(q.flatten(0, 1), k, replacement=True, generator=generator).view(B, M * k)
        child, slot = child[:, :width], (torch.arange(width, device=dev) // k).expand(B, width)
        qc = take_rows(q, slot)
        score = fscore.gather(1, slot) + qc.gather(2, child[..., None]).squeeze(-1).log()
        tokens.append(child)
        parents.append(ids.gather(1, slot))
        probs.append(qc)
        level_ids = count + torch.arange(width, device=dev).expand(B, -1)
        count += width
        if count >= N:
            break
        best = score.topk(min(k, width), dim=1).indices  # sorted: best first
        frontier = slot.gather(1, best)
        toks, ids, fscore = child.gather(1, best), level_ids.gather(1, best), score.gather(1, best)
    tok, par, q = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(probs, 1)
    return DraftTree(tok, par, torch.full((B,), count, dtype=torch.int64, device=dev), q)
