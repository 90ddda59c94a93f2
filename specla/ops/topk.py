"""The top-``k`` log-probabilities of each row of logits: what a drafter expands a draft node with
(EAGLE-2's top-``k`` children, scored by log-probability; :mod:`specla.drafters.pruning`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .norm import compute_dtype


def log_softmax_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest log-probabilities of each row and their token ids, largest first; equal
    values in increasing token order (a stable sort, so the choice is defined wherever ``torch.topk``
    leaves it open, e.g. bfloat16 ties). Twin of :func:`specla.ops.topk_triton.log_softmax_topk`.

    Args:
        logits: ``[..., V]`` any float dtype; k: ``1 <= k <= V``.
    Returns:
        ``(values [..., k]`` log-probabilities in float32 (float64 for float64 logits),
        ``ids [..., k]`` int64).
    Raises:
        ValueError: ``k`` outside ``1..V``.
    """
    V = logits.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"k must be in 1..{V} (the vocabulary), got {k}")
    logp = torch.log_softmax(logits.to(compute_dtype(logits)), dim=-1)
    values, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]
