"""Elementwise activations and gates the plugins share, in PyTorch: the twins of
:mod:`specla.ops.act_triton` (same formulas and intermediate roundings; FLA computes them the same
way in its layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def swiglu(gu: Tensor, inter: int) -> Tensor:
    """``silu(gu[..., :inter]) * gu[..., inter:]``: the MLP's SwiGLU from one stacked gate/up
    projection ``gu [..., 2 * inter]``; result ``[..., inter]`` in ``gu.dtype`` (each of the two
    operations rounds to it, as in the unstacked form).

    Raises:
        ValueError: ``gu``'s last dim is not ``2 * inter``.
    """
    if gu.shape[-1] != 2 * inter:
        raise ValueError(f"gu has {gu.shape[-1]} channels, expected 2 * {inter}")
    return F.silu(gu[..., :inter]) * gu[..., inter:]


def decay_and_sigmoid_gates(a: Tensor, b: Tensor, dt_bias: Tensor, neg_A: Tensor, beta_scale: float = 1.0,
                            dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The log-decay and write gates of a gated delta rule (FLA's ``GatedDeltaNet``):
    ``g = neg_A * softplus(a + dt_bias)`` and ``beta = sigmoid(b) * beta_scale``, in ``dtype``.

    Args:
        a, b: ``[..., HV]`` raw projections (any float dtype; cast to ``dtype`` first).
        dt_bias, neg_A: ``[HV]`` (``neg_A = -exp(A_log)``), in ``dtype``.
        beta_scale: 2 when negative eigenvalues are allowed, else 1.
    Returns:
        ``g, beta``: ``[..., HV]`` in ``dtype``.
    """
    g = neg_A * F.softplus(a.to(dtype) + dt_bias)
    beta = torch.sigmoid(b.to(dtype))
    return g, (beta * beta_scale if beta_scale != 1.0 else beta)
