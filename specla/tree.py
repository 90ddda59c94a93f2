"""Draft trees: the token candidates one speculative step submits for verification.

Shapes (docs/DESIGN.md section 2): ``B`` sequences, ``N`` draft nodes per sequence (root excluded).
Node ``i`` of sequence ``b`` has token ``tokens[b, i]`` and parent ``parents[b, i]``; ``-1`` means
the node is a child of the root (the last committed token, whose output the target has not yet
computed). Nodes are in topological order (``parents[b, i] < i``). Sequences may hold fewer nodes
than ``N``: the first ``num_nodes[b]`` are real, the rest are padding that verify computes as
harmless children of the root (token 0) and acceptance never follows.

Inside adapters the root is made explicit as node 0 of an ``N + 1``-node tree
(:meth:`DraftTree.parents_with_root`); the mask helpers below work on either form.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .errors import BudgetError, InvalidTokenError, InvalidTreeError


def inclusive_ancestor_mask(parents: Tensor) -> Tensor:
    """Inclusive-ancestor mask ``M_incl[b, i, j] = True`` iff node ``j`` is on the root path of ``i``
    (``i`` itself included).

    Args:
        parents: ``[B, T]`` int64, topologically ordered (``parents[b, i] < i``, ``-1`` = root child).
    Returns:
        ``[B, T, T]`` bool, lower triangular.
    Formula: docs/DESIGN.md section 3 (row ``i`` = row of its parent plus ``e_i``), computed as the
    reflexive-transitive closure of the parent relation by repeated squaring: ``ceil(log2 T)``
    batched products instead of a loop over the ``T`` nodes (a recorded step launches a handful
    of kernels, not ``5 T``).
    """
    B, T = parents.shape
    idx = torch.arange(T, device=parents.device)
    mask = (parents[:, :, None] == idx) | (idx[:, None] == idx)[None]  # parent or self
    for _ in range(max(T - 1, 0).bit_length()):  # after k squarings: ancestors up to 2^k levels up
        m = mask.to(torch.float32)  # 0/1 products summed over at most T terms: exact
        mask = torch.bmm(m, m) > 0
    return mask


def node_depths(parents: Tensor) -> Tensor:
    """Depth of every node: ``1`` for children of the root, parent depth + 1 otherwise.

    Args:
        parents: ``[B, T]`` int64, topologically ordered.
    Returns:
        ``[B, T]`` int64.
    """
    return inclusive_ancestor_mask(parents).sum(-1)


@dataclass(frozen=True)
class Chain:
    """One chain of a heavy-light decomposition.

    Attributes:
        nodes: node indices, each the (heavy) child of the previous one.
        parent: the node the chain hangs from (``-1`` = the root).
        wave: ``0`` for chains hanging from the root, else the parent chain's wave + 1; chains of
            one wave can run in parallel once the previous waves are done.
    """

    nodes: tuple[int, ...]
    parent: int
    wave: int


def heavy_light_chains(parents: list[int]) -> list[Chain]:
    """Heavy-light decomposition of one sequence's tree into chains (docs/DESIGN.md section 4, hybrid
    verify): the heavy child of a node is the child with the largest subtree (lowest index on ties).
    Any root-to-leaf path crosses O(log N) light edges, so there are O(log N) waves.

    Args:
        parents: the ``num_nodes`` valid parents of one sequence, topologically ordered.
    Returns:
        chains ordered by (wave, first node); every node is in exactly one chain.
    """
    n = len(parents)
    size = [1] * n
    for i in range(n - 1, -1, -1):
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    children: list[list[int]] = [[] for _ in range(n + 1)]  # slot n holds the root's children
    for i, p in enumerate(parents):
        children[p if p >= 0 else n].append(i)
    heavy = [max(c, key=lambda j: (size[j], -j)) if c else -1 for c in children]
    chains: list[Chain] = []
    starts = [(i, -1, 0) for i in children[n]]  # every root child heads a chain (the root is virtual)
    while starts:
        head, parent, wave = starts.pop(0)
        nodes = [head]
        while heavy[nodes[-1]] >= 0:
            nodes.append(heavy[nodes[-1]])
        for node in nodes:
            starts += [(c, node, wave + 1) for c in children[node] if c != heavy[node]]
        chains.append(Chain(tuple(nodes), parent, wave))
    return sorted(chains, key=lambda c: (c.wave, c.nodes[0]))


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, padded to a common width ``N``.

    Attributes:
        tokens: ``[B, N]`` int64 draft token ids (padding nodes hold 0).
        parents: ``[B, N]`` int64 parent index, ``-1`` = child of the root (padding nodes hold -1).
        num_nodes: ``[B]`` int64, how many leading nodes of each row are real.
        draft_probs: optional ``[B, N, vocab]`` float, the distribution each node's token was
            sampled from (a sampling drafter's ``q``; may live on another device than the
            tokens). ``None``: the drafts count as deterministic (one-hot ``q``), which is
            lossless for any drafter but accepts less when the tokens were in fact sampled.

    Construction checks the structure (not token ranges or budgets: see :meth:`validate`).

    Raises:
        InvalidTreeError: wrong shapes/dtypes/devices, a parent at or after its child, a parent
            below -1, ``num_nodes`` outside ``0..N``.
    """

    tokens: Tensor
    parents: Tensor
    num_nodes: Tensor
    draft_probs: Tensor | None = None

    def __post_init__(self) -> None:
        t, p, n = self.tokens, self.parents, self.num_nodes
        q = self.draft_probs
        if q is not None and (q.dim() != 3 or q.shape[:2] != t.shape or not q.is_floating_point()):
            raise InvalidTreeError(f"draft_probs must be float [B, N, vocab] matching tokens {tuple(t.shape)}, "
                                   f"got {q.dtype} {tuple(q.shape)}")
        if t.dim() != 2 or p.shape != t.shape or n.shape != t.shape[:1]:
            raise InvalidTreeError(
                f"draft tree shapes must be tokens [B, N], parents [B, N], num_nodes [B]; got "
                f"{tuple(t.shape)}, {tuple(p.shape)}, {tuple(n.shape)}"
            )
        for name, x in (("tokens", t), ("parents", p), ("num_nodes", n)):
            if x.dtype != torch.int64:
                raise InvalidTreeError(f"draft tree {name} must be int64, got {x.dtype}")
            if x.device != t.device:
                raise InvalidTreeError(f"draft tree {name} is on {x.device}, tokens on {t.device}")
        N = t.shape[1]
        if bool(((n < 0) | (n > N)).any()):
            raise InvalidTreeError(f"num_nodes must lie in 0..{N}, got {n.tolist()}")
        valid = torch.arange(N, device=t.device)[None, :] < n[:, None]
        idx = torch.arange(N, device=t.device)[None, :].expand_as(p)
        bad = valid & ((p >= idx) | (p < -1))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise InvalidTreeError(
                f"sequence {b}, node {i}: parent {int(p[b, i])} is not in -1..{i - 1}; nodes must be "
                "in topological order (parent before child), which also rules out cycles"
            )
        # canonical padding: never let a placeholder id reach an embedding
        object.__setattr__(self, "tokens", torch.where(valid, t, torch.zeros_like(t)))
        object.__setattr__(self, "parents", torch.where(valid, p, torch.full_like(p, -1)))

    @classmethod
    def trusted(cls, tokens: Tensor, parents: Tensor, num_nodes: Tensor,
                draft_probs: Tensor | None = None) -> "DraftTree":
        """A tree built by device code that guarantees the structure itself (canonical padding:
        token 0, parent -1), *without* the construction checks: they read values on the host,
        which a CUDA graph cannot do and which costs a synchronisation per step on a GPU.
        Same shapes as the class; nothing is checked or copied. A host drafter's trees are
        checked by the engine all the same (:func:`specla.step.host_proposal`)."""
        tree = object.__new__(cls)
        for name, x in (("tokens", tokens), ("parents", parents), ("num_nodes", num_nodes),
                        ("draft_probs", draft_probs)):
            object.__setattr__(tree, name, x)
        return tree

    @classmethod
    def from_lists(
        cls, trees: list[tuple[list[int], list[int]]], device: torch.device | str = "cpu"
    ) -> "DraftTree":
        """Build a padded batch from per-sequence ``(tokens, parents)`` lists.

        Raises:
            InvalidTreeError: a row's token and parent lists differ in length, or see the class.
        """
        for b, (tok, par) in enumerate(trees):
            if len(tok) != len(par):
                raise InvalidTreeError(f"sequence {b}: {len(tok)} tokens but {len(par)} parents")
        N = max((len(tok) for tok, _ in trees), default=0)
        tokens = torch.zeros(len(trees), N, dtype=torch.int64)
        parents = torch.full((len(trees), N), -1, dtype=torch.int64)
        for b, (tok, par) in enumerate(trees):
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.int64)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.int64)
        num = torch.tensor([len(tok) for tok, _ in trees], dtype=torch.int64)
        return cls(tokens.to(device), parents.to(device), num.to(device))

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> "DraftTree":
        """A batch of trees with no draft nodes (a plain autoregressive step)."""
        z = torch.zeros(batch_size, 0, dtype=torch.int64, device=device)
        return cls.trusted(z, z.clone(), torch.zeros(batch_size, dtype=torch.int64, device=device))

    @property
    def batch_size(self) -> int:
        """``B``, the number of sequences."""
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """``N``, the padded number of draft nodes per sequence."""
        return self.tokens.shape[1]

    @cached_property
    def valid(self) -> Tensor:
        """``[B, N]`` bool, real (non-padding) nodes."""
        return torch.arange(self.width, device=self.tokens.device)[None, :] < self.num_nodes[:, None]

    @cached_property
    def depth(self) -> Tensor:
        """``[B, N]`` int64, depth of each node (root children are depth 1; padding is 1): the
        row sums of :attr:`ancestor_mask` (:func:`node_depths`), which is computed once."""
        return self.ancestor_mask.sum(-1)

    @cached_property
    def parents_with_root(self) -> Tensor:
        """``[B, N + 1]`` int64 parents of the tree with the root made node 0 (``-1`` for it)."""
        root = torch.full((self.batch_size, 1), -1, dtype=torch.int64, device=self.parents.device)
        return torch.cat([root, self.parents + 1], dim=1)

    @cached_property
    def ancestor_mask(self) -> Tensor:
        """``M_incl`` ``[B, N, N]`` bool over draft nodes (root excluded)."""
        return inclusive_ancestor_mask(self.parents)

    @cached_property
    def strict_ancestor_mask(self) -> Tensor:
        """``M_strict = M_incl - I`` ``[B, N, N]`` bool."""
        return self.ancestor_mask & ~torch.eye(self.width, dtype=torch.bool, device=self.tokens.device)

    def limit_depth(self, limits: Tensor) -> "DraftTree":
        """The same trees without nodes deeper than ``limits[b]`` (``[B]`` int64); the kept set is
        ancestor-closed and keeps its order. Returns ``self`` when nothing is dropped."""
        keep = self.valid & (self.depth <= limits.to(self.depth.device)[:, None])
        if bool((keep == self.valid).all()):
            return self
        rows, kept = [], []
        for b in range(self.batch_size):
            idx = keep[b].nonzero().flatten().tolist()
            pos = {node: j for j, node in enumerate(idx)}
            par = [int(self.parents[b, i]) for i in idx]
            rows.append(([int(self.tokens[b, i]) for i in idx], [pos[p] if p >= 0 else -1 for p in par]))
            kept.append(idx)
        tree = DraftTree.from_lists(rows, self.tokens.device)
        if self.draft_probs is None:
            return tree
        width = tree.tokens.shape[1]
        index = torch.tensor([i + [0] * (width - len(i)) for i in kept], dtype=torch.int64)
        q = self.draft_probs.gather(1, index.to(self.draft_probs.device)[..., None].expand(-1, -1, self.draft_probs.shape[-1]))
        return DraftTree(tree.tokens, tree.parents, tree.num_nodes, q)

    def path(self, b: int, node: int) -> list[int]:
        """Root-to-``node`` path of sequence ``b`` as node indices (the root itself excluded)."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[b, node])
        return out[::-1]

    def chains(self, b: int) -> list[Chain]:
        """Heavy-light chain decomposition of sequence ``b`` (see :func:`heavy_light_chains`)."""
        return heavy_light_chains(self.parents[b, : int(self.num_nodes[b])].tolist())

    def validate(self, *, vocab_size: int, max_nodes: int, max_depth: int) -> None:
        """Check token ranges and the budget.

        Raises:
            BudgetError: a sequence has more than ``max_nodes`` nodes or a path deeper than
                ``max_depth``.
            InvalidTokenError: a real node's token is negative or ``>= vocab_size``.
        """
        if self.width and int(self.num_nodes.max()) > max_nodes:
            raise BudgetError(
                f"draft tree has {int(self.num_nodes.max())} nodes, over the budget N={max_nodes}"
            )
        if self.width and int(torch.where(self.valid, self.depth, 0).max()) > max_depth:
            raise BudgetError(
                f"draft tree depth {int(torch.where(self.valid, self.depth, 0).max())} exceeds "
                f"max_depth={max_depth}"
            )
        bad = self.valid & ((self.tokens < 0) | (self.tokens >= vocab_size))
        if bool(bad.any()):
            b, i = (int(x) for x in bad.nonzero()[0])
            raise InvalidTokenError(
                f"sequence {b}, draft node {i}: token id {int(self.tokens[b, i])} is outside the "
                f"vocabulary 0..{vocab_size - 1}"
            )
