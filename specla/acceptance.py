"""Acceptance rules over draft trees, shared by every plugin (never reimplemented per plugin)."""

from __future__ import annotations

import torch
from torch import Tensor

from .records import Acceptance
from .tree import DraftTree


def accept_greedy(tree: DraftTree, logits: Tensor) -> Acceptance:
    """Greedy tree acceptance with a bonus token.

    Walk from the root; at each node follow the first child (lowest index) whose token equals the
    target's argmax at that node; stop at the first node with no such child. The target's argmax
    at the stopping node is the bonus token. The output equals greedy autoregressive decoding of
    the target (SpecInfer / EAGLE tree verification, greedy case).

    Args:
        tree: ``B`` draft trees of width ``N``.
        logits: ``[B, N + 1, vocab]`` target logits, row 0 for the root, row ``i + 1`` for draft
            node ``i`` (any float dtype).
    Returns:
        :class:`Acceptance` with ``path`` ``[B, D + 1]`` where ``D`` is the deepest real node.
    Raises:
        ValueError: ``logits`` is not ``[B, N + 1, vocab]``.
    """
    B, N = tree.tokens.shape
    if logits.dim() != 3 or logits.shape[:2] != (B, N + 1):
        raise ValueError(f"logits must be [B={B}, N+1={N + 1}, vocab], got {tuple(logits.shape)}")
    target = logits.argmax(-1)  # [B, N + 1]
    parents = tree.parents_with_root[:, 1:]  # [B, N], parent in root-explicit indexing
    depth = int(torch.where(tree.valid, tree.depth, 0).max()) if N else 0
    rows = torch.arange(B, device=logits.device)
    cur = torch.zeros(B, dtype=torch.int64, device=logits.device)
    alive = torch.ones(B, dtype=torch.bool, device=logits.device)
    path = torch.full((B, depth + 1), -1, dtype=torch.int64, device=logits.device)
    path[:, 0] = 0
    tokens = torch.full((B, depth), -1, dtype=torch.int64, device=logits.device)
    for d in range(depth):
        match = tree.valid & (parents == cur[:, None]) & (tree.tokens == target[rows, cur][:, None])
        hit = match.any(-1) & alive
        child = match.int().argmax(-1)  # first matching child
        cur = torch.where(hit, child + 1, cur)
        path[:, d + 1] = torch.where(hit, cur, path[:, d + 1])
        tokens[:, d] = torch.where(hit, tree.tokens[rows, child], tokens[:, d])
        alive = hit
    num_accepted = (path >= 0).sum(-1) - 1
    return Acceptance(path=path, num_accepted=num_accepted, bonus=target[rows, cur], tokens=tokens)
