"""Sequential twins of the shared operators (explicit loops along each node's root path):
executable documentation and the oracle :mod:`specla.ops.conv` and its kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def root_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the first node below the committed state down to ``node``."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def naive_tree_conv(x, window, weight, bias, parents):
    """Per-path causal short convolution + SiLU over a batch of trees.

    Args:
        x: ``[B, T, D]``; window: ``[B, C - 1, D]`` (oldest first); weight: ``[D, C]``;
        bias: ``[D]`` or None; parents: ``[B, T]`` int64.
    Returns:
        ``y [B, T, D]`` in x.dtype, ``windows [B, T, C - 1, D]`` (the conv window after each node).
    """
    B, T, D = x.shape
    C = weight.shape[1]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(B, T, D, dtype=ct, device=x.device)
    windows = torch.zeros(B, T, C - 1, D, dtype=x.dtype, device=x.device)
    for b in range(B):
        par = parents[b].tolist()
        for i in range(T):
            seq = [window[b, t] for t in range(C - 1)] + [x[b, j] for j in root_path(par, i)]
            last = torch.stack(seq[-C:]).to(ct)  # [C, D], oldest first: tap c meets last[c]
            acc = (last.T * weight.to(ct)).sum(-1)
            y[b, i] = acc + (bias.to(ct) if bias is not None else 0)
            windows[b, i] = torch.stack(seq[len(seq) - (C - 1):]) if C > 1 else windows[b, i]
    return F.silu(y).to(x.dtype), windows


def naive_rms_norm(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of one vector (or a batch of them) over the last dim, in float32 (float64 for
    float64 inputs), FLA's ``RMSNorm`` reference; returned in the compute dtype. ``w`` ``None``:
    a norm without a weight (FLA's ``elementwise_affine=False``)."""
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * w.to(x.dtype) if w is not None else x
