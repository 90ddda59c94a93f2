"""Triton twin of :func:`specla.tree.inclusive_ancestor_mask` (and the depths read from it): one
launch where the PyTorch form, a closure by repeated squaring, takes about fifteen small ones
(casts, batched products, comparisons, the row sums) in every verify pass of a recorded step,
which is bound by the number of kernels it launches. One program per tree climbs from every
node to the root, one parent per iteration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out


@triton.jit
def _ancestor_mask_kernel(parents, mask, depth, T, TP: tl.constexpr):
    """Tree ``b``: ``mask [b, i, j]`` = node ``j`` is ``i`` or an ancestor of ``i``; ``depth [b, i]``
    = its strict ancestors."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, TP)
    inside = i < T
    on = (i[:, None] == i[None, :]) & inside[:, None] & inside[None, :]
    cur = tl.load(parents + b * T + i, mask=inside, other=-1)
    count = tl.zeros([TP], dtype=tl.int64)
    for _ in range(T - 1):  # a path has at most T - 1 ancestors
        up = cur >= 0
        on = on | ((i[None, :] == cur[:, None]) & up[:, None])
        count += up.to(tl.int64)
        cur = tl.load(parents + b * T + cur, mask=up, other=-1)
    tl.store(mask + b * T * T + i[:, None] * T + i[None, :], on, mask=inside[:, None] & inside[None, :])
    tl.store(depth + b * T + i, count, mask=inside)


MAX_NODES = 128  # larger trees (no verify or prefill pass builds one): the twin


def ancestor_mask(parents: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The inclusive-ancestor mask and the depths of a batch of trees in one launch (up to
    :data:`MAX_NODES` nodes; the twin above).

    Args:
        parents: ``[B, T]`` int64, topologically ordered (``parents[b, i] < i``, ``-1`` = a root).
        out: optional preallocated contiguous ``(mask, depth)``.
    Returns:
        ``(mask [B, T, T]`` bool, as :func:`specla.tree.inclusive_ancestor_mask`,
        ``depth [B, T]`` int64, strict ancestors per node: ``mask.sum(-1) - 1``).
    Raises:
        ValueError: ``parents`` is not a ``[B, T]`` int64 tensor, or ``out`` is not contiguous
            tensors of the result's shapes and dtypes.
    """
    if parents.dim() != 2 or parents.dtype != torch.int64:
        raise ValueError(f"parents must be int64 [B, T], got {parents.dtype} {list(parents.shape)}")
    B, T = parents.shape
    if out is not None:
        check_out(out[:1], (B, T, T), (torch.bool,), parents.device)
        check_out(out[1:], (B, T), (torch.int64,), parents.device)
    if T > MAX_NODES:  # one program holds a [T, T] tile: larger trees take the twin
        from ..tree import inclusive_ancestor_mask

        ref = inclusive_ancestor_mask(parents)
        if out is None:
            return ref, ref.sum(-1) - 1
        out[0].copy_(ref)
        torch.sub(ref.sum(-1), 1, out=out[1])
        return out
    parents = parents.contiguous()
    mask, depth = out if out is not None else (torch.empty(B, T, T, dtype=torch.bool, device=parents.device),
                                               torch.empty(B, T, dtype=torch.int64, device=parents.device))
    if B and T:
        _ancestor_mask_kernel[(B,)](parents, mask, depth, T, TP=triton.next_power_of_2(T))
    return mask, depth
