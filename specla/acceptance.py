"""Acceptance rules over draft trees, shared by every plugin (never reimplemented per plugin)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .ops import kernels
from .records import Acceptance
from .tree import DraftTree

accept_kernels = kernels("specla.ops.accept_triton")


def accept_greedy(tree: DraftTree, logits: Tensor, max_depth: int | None = None, kernels: bool = False) -> Acceptance:
    """Greedy tree acceptance with a bonus token.

    Walk from the root; at each node follow the first child (lowest index) whose token equals the
    target's argmax at that node; stop at the first node with no such child. The target's argmax
    at the stopping node is the bonus token. The output equals greedy autoregressive decoding of
    the target (SpecInfer / EAGLE tree verification, greedy case).

    Args:
        tree: ``B`` draft trees of width ``N``.
        logits: ``[B, N + 1, vocab]`` target logits, row 0 for the root, row ``i + 1`` for draft
            node ``i`` (any float dtype).
        max_depth: a bound on the deepest real node, used as ``D`` instead of reading the trees'
            depth on the host (no synchronisation; CUDA graphs need it). ``None``: measured.
        kernels: with ``max_depth``, walk in one Triton launch
            (:func:`specla.ops.accept_triton.greedy_walk`; the same result) instead of the
            PyTorch form's fifty-odd operations: what a recorded step runs on a GPU.
    Returns:
        :class:`Acceptance` with ``path`` ``[B, D + 1]`` where ``D`` is the deepest real node
        (or ``min(max_depth, N)``).
    Raises:
        ValueError: ``logits`` is not ``[B, N + 1, vocab]``.
    """
    B, N = tree.tokens.shape
    if logits.dim() != 3 or logits.shape[:2] != (B, N + 1):
        raise ValueError(f"logits must be [B={B}, N+1={N + 1}, vocab], got {tuple(logits.shape)}")
    target = logits.argmax(-1)
    if kernels and max_depth is not None:
        dev = target.device
        return accept_kernels.greedy_walk(tree.parents.to(dev), tree.tokens.to(dev), tree.num_nodes.to(dev), target,
                                          max_depth)
    return _walk(tree, target, max_depth)


def _walk(tree: DraftTree, target: Tensor, max_depth: int | None) -> Acceptance:
    """From the root, follow the first child whose token equals ``target`` at the current node
    (``target`` ``[B, N + 1]`` int64, row 0 the root); the target token at the stopping node is
    the bonus. ``max_depth``: a static bound on the deepest real node (``None``: measured on the
    host).

    Computed for all nodes at once rather than level by level (a recorded step is bound by its
    launches: about 30 operations instead of 12 per level): a node is *chosen* when it is real,
    its token is the target's argmax at its parent, and no earlier sibling is chosen; it is on
    the accepted path when it and all its ancestors are chosen (the inclusive-ancestor mask) and
    it is at most ``D`` deep. Those nodes form one chain from the root, one per depth."""
    B, N = tree.tokens.shape
    dev = target.device
    parents = tree.parents.to(dev)  # [B, N], draft indexing, -1 = child of the root
    valid, tokens_in = tree.valid.to(dev), tree.tokens.to(dev)
    anc = tree.ancestor_mask.to(dev)  # [B, N, N] inclusive
    depth_of = tree.depth.to(dev)  # [B, N], from the same mask
    if max_depth is not None:
        D = min(max_depth, N)
    else:
        D = int(torch.where(valid, depth_of, 0).max()) if N else 0
    ok = valid & (tokens_in == target.gather(1, parents + 1))
    idx = torch.arange(N, device=dev)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (idx[:, None] > idx[None, :]) & ok[:, None, :]
    chosen = ok & ~earlier.any(-1)  # the first matching child of its parent
    on = ~(anc & ~chosen[:, None, :]).any(-1) & (depth_of <= D)  # chosen, with every ancestor
    slot = torch.where(on, depth_of - 1, D)  # the path's slot of each node; column D collects the rest
    nodes = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev).scatter_(1, slot, torch.where(on, idx + 1, -1))
    path = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), nodes[:, :D]], 1)
    tokens = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev).scatter_(
        1, slot, torch.where(on, tokens_in, -1))[:, :D]
    num_accepted = on.sum(-1)
    bonus = target.gather(1, path.gather(1, num_accepted[:, None])).squeeze(1)
    return Acceptance(path=path, num_accepted=num_accepted, bonus=bonus, tokens=tokens)


def sample_tokens(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row by inverse transform sampling: the first token whose cumulative
    probability exceeds ``u * total``. A token of probability 0 is never drawn (rounding at the
    top end falls back to the last token of positive probability).

    Args:
        probs: ``[..., vocab]`` probabilities (any float dtype; rows need not be normalised).
        uniforms: ``[...]`` draws from ``U[0, 1)``, one per row.
    Returns:
        ``[...]`` int64 token ids.
    Raises:
        ValueError: ``uniforms`` does not have ``probs``' leading shape.
    """
    if uniforms.shape != probs.shape[:-1]:
        raise ValueError(f"uniforms must be {tuple(probs.shape[:-1])}, got {tuple(uniforms.shape)}")
    cdf = probs.float().cumsum(-1).contiguous()
    value = uniforms.to(cdf.dtype)[..., None] * cdf[..., -1:]
    idx = torch.searchsorted(cdf, value.contiguous(), right=True).squeeze(-1)
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)  # the last token of positive probability
    return torch.minimum(idx, last)


def sampling_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The distribution a sampler draws from: ``softmax(logits / temperature)`` restricted to the
    ``top_k`` most likely tokens (``0``: all) and to the smallest set of most likely tokens whose
    mass reaches ``top_p``, renormalised (the usual transformers warpers, in that order).

    Stable at any positive temperature: the logits are shifted so that their maximum is 0 before
    the division, so a tiny temperature gives ``-inf`` (probability 0) for every token below the
    maximum and never ``inf - inf``; temperatures below float32's smallest normal number
    (about ``1.2e-38``) act as that number, which already puts every token whose logit differs
    from the maximum by more than ``1e-36`` at probability 0 (ties share the mass).

    Args:
        logits: ``[..., vocab]`` (any float dtype). temperature: ``> 0``.
    Returns:
        ``[..., vocab]`` float32 probabilities.
    Raises:
        ValueError: ``temperature <= 0``, ``top_k < 0`` or ``top_p`` outside ``(0, 1]``.
    """
    if temperature <= 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature > 0, top_k >= 0, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    x = logits.float()
    x = x - x.amax(-1, keepdim=True)
    # the top-k set is taken before the division: at a huge temperature the quotients round to
    # ties and the set would grow to the whole vocabulary (division by T > 0 keeps the order)
    kept = x >= x.topk(top_k, dim=-1).values[..., -1:] if top_k and top_k < x.shape[-1] else None
    x = x / max(temperature, torch.finfo(torch.float32).tiny)
    if kept is not None:
        x = x.masked_fill(~kept, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if top_p < 1:
        sp, idx = p.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp >= top_p  # the tokens after the mass already reached top_p
        p = p.scatter(-1, idx, sp.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    return p


def keyed_uniforms(seed: int, sequences: Sequence[int], positions: Sequence[int], width: int) -> Tensor:
    """Draws from ``U[0, 1)`` keyed by what they decide: ``u[b, d]`` depends only on ``(seed,
    sequences[b], positions[b] + d)``, the token of that sequence at that output position. A
    sampling step reads the draw of the position each node's token would take, so whichever
    budget (drafts, a chain, or none) decides a token, it is decided by the same number: with
    deterministic proposals a sampled run emits what plain decoding sampled with the same seed
    emits (:func:`accept_sampling`'s draw-and-match walk picks ``F^-1(u)`` at every accepted
    node), whatever schedule of budgets ran it, up to rounding: a verify pass and a plain step
    round the logits differently, and a draw that close to a boundary of ``F`` picks the
    neighbouring token.

    Each draw is the top 24 bits of a counter hash: SplitMix64's finalizer (Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators", OOPSLA 2014) applied to the seed, then
    mixed with the sequence and the position in turn.

    Args:
        seed: the run's seed, ``0 <= seed < 2**64``.
        sequences: ``[B]`` which sequence each row decodes (its prompt's index in the call).
        positions: ``[B]`` the output position of each row's next token (tokens emitted so far).
        width: draws per row: positions ``positions[b]`` to ``positions[b] + width - 1``.
    Returns:
        ``[B, width]`` float32 on the CPU, multiples of ``2**-24`` in ``[0, 1)``.
    """
    with np.errstate(over="ignore"):
        h = _mix(np.uint64(seed) + _GOLDEN)
        h = _mix(h ^ (np.asarray(sequences, dtype=np.uint64)[:, None] + _GOLDEN))
        h = _mix(h ^ (np.asarray(positions, dtype=np.uint64)[:, None] + np.arange(width, dtype=np.uint64)))
    return torch.from_numpy((h >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z):
    """SplitMix64's finalizer: a bijection of uint64 that scatters every input bit over the output."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def node_uniforms(tree: DraftTree, by_depth: Tensor) -> Tensor:
    """The draw each node of ``tree`` samples its target token with: its depth's (the root's is
    column 0), from draws by depth as :func:`keyed_uniforms` gives them.

    Args:
        tree: ``B`` draft trees of width ``N`` whose real nodes are at most ``by_depth.shape[1] - 1``
            deep. by_depth: ``[B, >= D + 1]`` float32 on the tree's device.
    Returns:
        ``[B, N + 1]`` float32 (padding nodes read depth 1's draw; no path reaches them).
    """
    depth = tree.depth.clamp(max=by_depth.shape[1] - 1).to(by_depth.device)
    return torch.cat([by_depth[:, :1], by_depth.gather(1, depth)], 1)


def accept_sampling(tree: DraftTree, target_probs: Tensor, draft_probs: Tensor | None,
                    generator: torch.Generator | None = None, *, uniforms: Tensor | None = None,
                    max_depth: int | None = None) -> Acceptance:
    """Lossless tree acceptance by recursive rejection sampling (SpecInfer, Miao et al. 2024;
    SpecTr, Sun et al. 2023): the emitted tokens follow the target's distribution exactly.

    At the current node (the root first), with residual ``r`` = the target's distribution there,
    try the children in index order: accept child ``x`` with probability
    ``min(1, r(x) / q(x))`` (``q``: the distribution that child's token was drawn from) and move
    to it; on rejection ``r <- normalise(max(r - q, 0))``. When every child is rejected, or the
    node has none, the bonus token is drawn from ``r``.

    Deterministic drafts (``draft_probs`` ``None``, e.g. ngram or a greedy tree) have one-hot
    ``q``: child ``x`` is accepted with probability ``r(x)``, and its rejection leaves ``r``
    restricted to the other tokens. Trying the children in turn is then the same as drawing one
    token ``y ~ r`` at the node and following the first child whose token is ``y`` (``y`` is the
    bonus when none is): one draw per node, taken for all nodes at once from ``uniforms``, and a
    walk with no host reads, which is how a CUDA graph samples.

    Args:
        tree: ``B`` draft trees of width ``N``; each node's token must have been drawn from its
            ``draft_probs`` row independently of its siblings (or be deterministic).
        target_probs: ``[B, N + 1, vocab]`` the target's sampling distribution at the root (row
            0) and after each draft node (row ``i + 1``), e.g. from :func:`sampling_probs`.
        draft_probs: ``[B, N, vocab]`` the distribution each draft node's token was drawn from,
            or ``None`` when every draft is deterministic.
        generator: the random source (a seeded generator repeats a run exactly).
        uniforms: with deterministic drafts, ``[B, N + 1]`` draws from ``U[0, 1)`` to use instead
            of drawing from ``generator`` (a CUDA graph's static buffer).
        max_depth: with deterministic drafts, a static bound on the deepest real node (as in
            :func:`accept_greedy`; ``None``: measured on the host).
    Returns:
        :class:`Acceptance` (as :func:`accept_greedy`, with the sampled bonus token).
    Raises:
        ValueError: shapes disagree.
    """
    B, N = tree.tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (B, N + 1):
        raise ValueError(f"target_probs must be [B={B}, N+1={N + 1}, vocab], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, N, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B={B}, N={N}, vocab], got {tuple(draft_probs.shape)}")
    if draft_probs is None:
        if uniforms is None:
            uniforms = torch.rand(B, N + 1, generator=generator, device=target_probs.device)
        return _walk(tree, sample_tokens(target_probs, uniforms), max_depth)
    dev = target_probs.device
    parents = tree.parents_with_root[:, 1:].to(dev)
    valid = tree.valid.to(dev)
    tokens_in = tree.tokens.to(dev)
    depth = int(torch.where(tree.valid, tree.depth, 0).max()) if N else 0
    rows = torch.arange(B, device=dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    r = target_probs[:, 0].float()
    path = torch.full((B, depth + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    tokens = torch.full((B, depth), -1, dtype=torch.int64, device=dev)
    for d in range(depth):
        is_child = valid & (parents == cur[:, None]) & ~done[:, None]
        rank = is_child.cumsum(-1) * is_child  # 1, 2, ... for the children of the current node
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for j in range(1, int(rank.max()) + 1):
            sel = rank == j
            trying = sel.any(-1) & ~moved
            c = sel.int().argmax(-1)
            x = tokens_in[rows, c]
            q = draft_probs[rows, c].float()
            u = torch.rand(B, generator=generator, device=dev)
            accept = trying & (u * q[rows, x] < r[rows, x])  # probability min(1, r(x) / q(x))
            residual = (r - q).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)
            # mass 0 only when r == q, where rejection has probability 0
            r = torch.where((trying & ~accept)[:, None] & (mass > 0), residual / mass.clamp(min=1e-30), r)
            moved |= accept
            cur = torch.where(accept, c + 1, cur)
            path[:, d + 1] = torch.where(accept, c + 1, path[:, d + 1])
            tokens[:, d] = torch.where(accept, x, tokens[:, d])
        r = torch.where(moved[:, None], target_probs[rows, cur].float(), r)
        done |= ~moved
    # r is no distribution only where the target's logits were not finite, which the step reports
    # (specla.step.nonfinite_rows); multinomial refuses such rows, so they draw from a stand-in
    usable = torch.isfinite(r).all(-1, keepdim=True) & (r.sum(-1, keepdim=True) > 0)
    bonus = torch.multinomial(torch.where(usable, r, 1.0), 1, generator=generator).squeeze(-1)
    num_accepted = (path >= 0).sum(-1) - 1
    return Acceptance(path=path, num_accepted=num_accepted, bonus=bonus, tokens=tokens)
