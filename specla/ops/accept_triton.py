"""Greedy tree acceptance in one launch: the walk of :func:`specla.acceptance.accept_greedy`
(twin: its all-nodes-at-once PyTorch form, about fifty small operations in a recorded step,
which is bound by the number of kernels it launches). One program per sequence walks at most
``D`` levels from the root: at each node, the first real child (lowest index) whose token is the
target's argmax there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..records import Acceptance
from . import check_out


@triton.jit
def _greedy_walk_kernel(target, tokens, parents, num_nodes, path, num_accepted, bonus, accepted, N, D,
                        s_target, s_tree, NP: tl.constexpr):
    """Sequence ``b``: ``path [b, :D + 1]`` (root-explicit, ``-1`` padded), ``accepted [b, :D]``
    tokens (``-1`` padded), ``num_accepted [b]`` and ``bonus [b]`` (the target at the last node)."""
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NP)
    inside = idx < N
    par = tl.load(parents + b * s_tree + idx, mask=inside, other=-2)
    tok = tl.load(tokens + b * s_tree + idx, mask=inside, other=-1)
    real = inside & (idx < tl.load(num_nodes + b))
    cur = b * 0 - 1  # the current node in draft indexing (-1: the root)
    count = b * 0
    done = b * 0
    tl.store(path + b * (D + 1), count)
    for d in range(D):
        want = tl.load(target + b * s_target + cur + 1)
        nxt = tl.min(tl.where(real & (par == cur) & (tok == want), idx, NP), axis=0)
        go = (nxt < NP) & (done == 0)
        tl.store(path + b * (D + 1) + d + 1, tl.where(go, nxt + 1, -1).to(tl.int64))
        tl.store(accepted + b * D + d, tl.where(go, tl.sum(tl.where(idx == nxt, tok, 0), axis=0), -1))
        count += go.to(tl.int64)
        cur = tl.where(go, nxt.to(tl.int64), cur)
        done = tl.where(go, done, 1)
    tl.store(num_accepted + b, count)
    tl.store(bonus + b, tl.load(target + b * s_target + cur + 1))


def greedy_walk(parents: Tensor, tokens: Tensor, num_nodes: Tensor, target: Tensor, max_depth: int,
                out: Acceptance | None = None) -> Acceptance:
    """:func:`specla.acceptance.accept_greedy`'s walk in one launch (twin:
    ``specla.acceptance._walk``).

    Args:
        parents, tokens: ``[B, N]`` int64 draft trees (parents in draft indexing, ``-1`` = child of
            the root, padding canonical); num_nodes: ``[B]`` int64 real nodes per tree.
        target: ``[B, N + 1]`` int64 the target's argmax per node, row 0 the root.
        max_depth: ``D``, the most levels walked (a bound on the deepest real node).
        out: optional preallocated result (contiguous int64 tensors of the returned shapes).
    Returns:
        :class:`Acceptance` with ``path [B, min(D, N) + 1]`` and ``tokens [B, min(D, N)]``.
    Raises:
        ValueError: shapes disagree, a tensor is not of integers, ``max_depth < 0``, or ``out`` is
            not contiguous int64 tensors of the returned shapes.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, N], got {list(tokens.shape)}")
    B, N = tokens.shape
    if parents.shape != (B, N) or num_nodes.shape != (B,) or target.shape != (B, N + 1):
        raise ValueError(f"expected parents [B={B}, N={N}], num_nodes [{B}], target [{B}, {N + 1}]; got "
                         f"{list(parents.shape)}, {list(num_nodes.shape)}, {list(target.shape)}")
    if any(x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool
           for x in (parents, tokens, num_nodes, target)):
        raise ValueError("parents, tokens, num_nodes and target must be integer tensors")
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    D, dev = min(max_depth, N), tokens.device
    if out is not None:
        check_out((out.path,), (B, D + 1), (torch.int64,), dev)
        check_out((out.tokens,), (B, D), (torch.int64,), dev)
        check_out((out.num_accepted, out.bonus), (B,), (torch.int64, torch.int64), dev)
    parents, tokens, target = (x.contiguous() for x in (parents, tokens, target))
    if out is None:
        out = Acceptance(path=torch.empty(B, D + 1, dtype=torch.int64, device=dev),
                         num_accepted=torch.empty(B, dtype=torch.int64, device=dev),
                         bonus=torch.empty(B, dtype=torch.int64, device=dev),
                         tokens=torch.empty(B, D, dtype=torch.int64, device=dev))
    path, num, bonus, accepted = out.path, out.num_accepted, out.bonus, out.tokens
    if B:
        _greedy_walk_kernel[(B,)](target, tokens, parents, num_nodes.contiguous(), path, num, bonus, accepted, N, D,
                                  target.stride(0), tokens.stride(0), NP=triton.next_power_of_2(max(N, 1)))
    return out
