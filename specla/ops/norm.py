"""Normalisations shared by the architecture plugins, computed in float32 (float64 for float64
inputs) as FLA does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests); every other dtype computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """RMSNorm computed in float32 (float64 for float64 inputs), returned in ``x.dtype`` (FLA);
    ``unit_offset``: scaled by ``1 + weight`` (the zero-centred RMSNorm of Qwen3.5 and
    Qwen3-Next: transformers' ``Qwen3_5RMSNorm``)."""
    xc = x.to(compute_dtype(x))
    w = weight.to(xc.dtype)
    return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * (1 + w if unit_offset else w)).to(x.dtype)


def gated_rms_norm(x: Tensor, weight: Tensor, eps: float, gate: Tensor, activation: str = "swish",
                   out_dtype: torch.dtype | None = None) -> Tensor:
    """``rms_norm(x)`` (rounded to ``x.dtype``) times ``act(gate)`` in the compute dtype, as FLA's
    ``FusedRMSNormGated`` (``activation``: ``swish``/``silu`` or ``sigmoid``); returned in
    ``out_dtype`` (default: the compute dtype). Twin of :func:`specla.ops.norm_triton.rms_norm`
    with a gate."""
    t = rms_norm(x, weight, eps).to(compute_dtype(x))
    ga = gate.to(t.dtype)
    t = t * (torch.sigmoid(ga) if activation == "sigmoid" else F.silu(ga))
    return t if out_dtype is None else t.to(out_dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in the compute dtype (FLA ``l2norm``)."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
