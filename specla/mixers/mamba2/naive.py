"""Sequential pure-PyTorch references for Mamba2: explicit loops, one token at a time.

Executable documentation and the oracle every faster path (the batched reference in
``reference.py``) is tested against. Slow on purpose: each tree node is computed by walking its
own root path from the committed state, exactly as autoregressive decoding would. Formulas:
docs/DESIGN.md section 5 and the single-token decode branch of FLA's ``Mamba2.torch_forward``
(``fla/layers/mamba2.py``): ``h = exp(dt A) h + dt B x^T``, ``y = C^T h + D x``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.ops.naive import naive_rms_norm, root_path


def ssd_step(S: Tensor, x: Tensor, dt: Tensor, A: Tensor, b: Tensor, c: Tensor, D: Tensor):
    """One Mamba2 (SSD) step for one head.

    Args:
        S: ``[N, P]`` state; x: ``[P]``; dt, A: scalars (0-dim, ``A < 0``); b, c: ``[N]``;
        D: scalar or ``[P]``.
    Returns:
        ``(S_new [N, P], y [P])``.
    """
    S = torch.exp(dt * A) * S + torch.outer(b, dt * x)
    return S, S.T @ c + D * x


def naive_tree_ssd(x, dt, A, Bm, Cm, D, S0, parents):
    """Per-path sequential SSD over a batch of trees.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` (after softplus/clamp); A: ``[H]`` (negative);
        Bm, Cm: ``[B, T, G, N]``; D: ``[H]`` or ``[H, P]``; S0: ``[B, H, N, P]``;
        parents: ``[B, T]`` int64 (``-1`` = child of the committed state).
    Returns:
        ``y [B, T, H, P]``, ``u [B, T, H, P]`` (``dt * x``), ``G [B, T, H]`` (log decay summed
        along the path), ``states [B, T, H, N, P]`` (state after each node), all in ``S0.dtype``.
    """
    B, T, H, P = x.shape
    grp = H // Bm.shape[2]
    ct = S0.dtype
    y, u = torch.zeros(B, T, H, P, dtype=ct, device=S0.device), torch.zeros(B, T, H, P, dtype=ct, device=S0.device)
    G = torch.zeros(B, T, H, dtype=ct, device=S0.device)
    states = torch.zeros(B, T, *S0.shape[1:], dtype=ct, device=S0.device)
    for b in range(B):
        par = parents[b].tolist()
        for i in range(T):
            for h in range(H):
                S, Gs = S0[b, h].clone(), torch.zeros((), dtype=ct, device=S0.device)
                for j in root_path(par, i):
                    S, out = ssd_step(S, x[b, j, h].to(ct), dt[b, j, h].to(ct), A[h].to(ct),
                                      Bm[b, j, h // grp].to(ct), Cm[b, j, h // grp].to(ct), D[h].to(ct))
                    Gs = Gs + dt[b, j, h].to(ct) * A[h].to(ct)
                y[b, i, h], G[b, i, h], states[b, i, h] = out, Gs, S
                u[b, i, h] = dt[b, i, h].to(ct) * x[b, i, h].to(ct)
    return y, u, G, states


def naive_gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                         norm_before_gate: bool) -> Tensor:
    """FLA ``rms_norm_ref`` for one token: ``y, z [Di]``, group by group; float32/float64 result."""
    ct = torch.float64 if y.dtype == torch.float64 else torch.float32
    y, gate = y.to(ct), F.silu(z.to(ct))
    if not norm_before_gate:
        y = y * gate
    out = torch.cat([naive_rms_norm(y[s : s + group_size], weight[s : s + group_size], eps)
                     for s in range(0, y.shape[0], group_size)])
    return out * gate if norm_before_gate else out
