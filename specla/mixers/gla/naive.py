"""Sequential pure-PyTorch references for GLA: explicit loops, one token at a time.

Executable documentation and the oracle every faster path (the batched reference in
``reference.py``, the Triton kernels) is tested against. Slow on purpose: each tree node is
computed by walking its own root path from the committed state, exactly as autoregressive
decoding would. Formulas: docs/DESIGN.md section 5 and FLA's ``naive_recurrent_gla``
(``fla/ops/gla/naive.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specla.ops.naive import root_path


def gla_step(S: Tensor, q: Tensor, k: Tensor, v: Tensor, gk: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One gated linear attention step for one head (FLA convention).

    Args:
        S: ``[K, V]`` state; q, k: ``[K]``; v: ``[V]``; gk: ``[K]`` per-channel log decay.
    Returns:
        ``(S_new [K, V], o [V])`` with ``S_new = diag(exp(gk)) S + k v^T``, ``o = S_new^T (scale q)``.
    """
    S = torch.exp(gk)[:, None] * S + torch.outer(k, v)
    return S, S.T @ (scale * q)


def naive_tree_gla(q, k, v, gk, S0, parents, scale):
    """Per-path sequential GLA over a batch of trees.

    Args:
        q, k, gk: ``[B, T, H, K]``; v: ``[B, T, H, V]``; S0: ``[B, H, K, V]``;
        parents: ``[B, T]`` int64 (``-1`` = child of the committed state); scale: float.
    Returns:
        ``o [B, T, H, V]``, ``Gk [B, T, H, K]`` (log decay summed along the path),
        ``states [B, T, H, K, V]`` (state after each node), all in ``S0.dtype``.
    """
    B, T, H, K = k.shape
    ct = S0.dtype
    o = torch.zeros(B, T, H, v.shape[-1], dtype=ct, device=S0.device)
    Gk = torch.zeros(B, T, H, K, dtype=ct, device=S0.device)
    states = torch.zeros(B, T, *S0.shape[1:], dtype=ct, device=S0.device)
    for b in range(B):
        par = parents[b].tolist()
        for i in range(T):
            for h in range(H):
                S, G = S0[b, h].clone(), torch.zeros(K, dtype=ct, device=S0.device)
                for j in root_path(par, i):
                    S, out = gla_step(S, q[b, j, h].to(ct), k[b, j, h].to(ct), v[b, j, h].to(ct),
                                      gk[b, j, h].to(ct), scale)
                    G = G + gk[b, j, h].to(ct)
                o[b, i, h], Gk[b, i, h], states[b, i, h] = out, G, S
    return o, Gk, states
