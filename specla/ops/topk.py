"""The top-``k`` log-probabilities of each row of logits: what a drafter expands a draft node with
(EAGLE-2's top-``k`` children, scored by log-probability; :mod:`specla.drafters.pruning`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .norm import compute_dtype


def log_softmax_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest log-probabilities of each row and their token ids, ranked by logit (in the
    compute dtype), equal logits in increasing token order: a stable sort, so the choice is
    defined wherever ``torch.topk`` leaves it open (bfloat16 ties), and two logits that round to
    the same log-probability keep their logit order. Twin of
    :func:`specla.ops.topk_triton.log_softmax_topk`.

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
    x = logits.to(compute_dtype(logits))
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.log_softmax(x, dim=-1).gather(-1, ids), ids
