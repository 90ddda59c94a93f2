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


def naive_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm of one vector (or a batch of them) over the last dim, in float32 (float64 for
    float64 inputs), FLA's ``RMSNorm`` reference; returned in the compute dtype."""
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def naive_tree_attention(q, k, v, k_cache, v_cache, cache_len, parents, *, scale=None, window=None):
    """Attention of each tree node over the cached prefix and its own root path, one node, head
    and key at a time in float64: the twin of :func:`specla.ops.attention.tree_attention`.

    Args:
        q: ``[B, T, H, Dh]``; k, v: ``[B, T, HKV, Dh]``; k_cache, v_cache: ``[B, S, HKV, Dh]``;
        cache_len: ``[B]`` int64; parents: ``[B, T]`` int64 root-explicit parents (the root,
        node 0, has ``-1``); scale: softmax scale (``None``: ``Dh ** -0.5``); window: sliding
        window in tokens or ``None``.
    Returns:
        ``[B, T, H, Dh]`` float64.
    """
    B, T, H, Dh = q.shape
    group = H // k.shape[2]
    scale = Dh**-0.5 if scale is None else scale
    out = torch.zeros(B, T, H, Dh, dtype=torch.float64)
    for b in range(B):
        n = int(cache_len[b])
        par = parents[b].tolist()
        for i in range(T):
            path = root_path(par, i)
            keys = [(p, k_cache[b, p], v_cache[b, p]) for p in range(n)] + \
                   [(n + d, k[b, j], v[b, j]) for d, j in enumerate(path)]
            pos = n + len(path) - 1
            keys = [kv for kv in keys if window is None or kv[0] > pos - window]
            for h in range(H):
                logits = torch.stack([q[b, i, h].double() @ kk[h // group].double() for _, kk, _ in keys])
                w = torch.softmax(logits * scale, 0)
                out[b, i, h] = sum(wj * vv[h // group].double() for wj, (_, _, vv) in zip(w, keys))
    return out
