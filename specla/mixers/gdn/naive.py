"""Sequential pure-PyTorch references for GDN: explicit loops, one token at a time.

Executable documentation and the oracle every faster path (the batched reference in
``reference.py``, the Triton kernels) is tested against. Slow on purpose: each tree node is
computed by walking its own root path from the committed state, exactly as autoregressive
decoding would. Formulas: docs/DESIGN.md section 4 and FLA's ``naive_recurrent_gated_delta_rule``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specla.ops.naive import root_path


def gdn_step(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float):
    """One gated delta rule step for one head (FLA convention).

    Args:
        S: ``[K, V]`` state; q, k: ``[K]`` (L2-normalised); v: ``[V]``; g, beta: scalars (0-dim).
    Returns:
        ``(S_new [K, V], o [V], delta [V])``.
    """
    S = torch.exp(g) * S
    delta = beta * (v - S.T @ k)
    S = S + torch.outer(k, delta)
    return S, S.T @ (scale * q), delta


def naive_tree_gdn(q, k, v, g, beta, S0, parents, scale):
    """Per-path sequential GDN over a batch of trees.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]``; S0: ``[B, HV, K, V]``;
        parents: ``[B, T]`` int64 (``-1`` = child of the committed state); scale: float.
    Returns:
        ``o [B, T, HV, V]``, ``delta [B, T, HV, V]``, ``G [B, T, HV]`` (log decay summed along
        the path), ``states [B, T, HV, K, V]`` (state after each node), all in ``S0.dtype``.
    """
    B, T, H, _ = k.shape
    HV = v.shape[2]
    ct = S0.dtype
    o = torch.zeros(B, T, HV, v.shape[-1], dtype=ct, device=S0.device)
    delta, G = torch.zeros_like(o), torch.zeros(B, T, HV, dtype=ct, device=S0.device)
    states = torch.zeros(B, T, *S0.shape[1:], dtype=ct, device=S0.device)
    for b in range(B):
        par = parents[b].tolist()
        for i in range(T):
            for hv in range(HV):
                h = hv // (HV // H)
                S, Gs = S0[b, hv].clone(), torch.zeros((), dtype=ct, device=S0.device)
                for j in root_path(par, i):
                    S, out, d = gdn_step(
                        S, q[b, j, h].to(ct), k[b, j, h].to(ct), v[b, j, hv].to(ct),
                        g[b, j, hv].to(ct), beta[b, j, hv].to(ct), scale,
                    )
                    Gs = Gs + g[b, j, hv].to(ct)
                o[b, i, hv], delta[b, i, hv], G[b, i, hv], states[b, i, hv] = out, d, Gs, S
    return o, delta, G, states
