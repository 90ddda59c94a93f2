"""Pure-PyTorch tree-masked Mamba2 (SSD) operators: the reference path that runs on CPU and GPU.

These are the batched, factorized forms of docs/DESIGN.md section 5 (no loops over nodes except to
build masks). ``naive.py`` holds the sequential per-path twins they are tested against.

Shapes: ``B`` sequences, ``T`` tree nodes (root-explicit trees have ``T = N + 1``), ``H`` SSM
heads, ``P`` head dim (the value dim ``V`` of docs/DESIGN.md), ``N`` SSM state size (the key dim
``K``), ``G`` groups of the input/output matrices (head ``h`` reads group ``h // (H // G)``, as
FLA's ``Mamba2``), ``D`` channels, ``C`` conv width. The SSM matrices are called ``Bm``/``Cm``
so that ``B`` stays the batch size. The state of a head is ``[N, P]`` (``h_t = exp(a_t) h_{t-1}
+ Bm_t u_t^T``, ``y_t = h_t^T Cm_t``): the ``[K, V]`` layout of the other plugins, i.e. FLA's
``[P, N]`` cache transposed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.ops.norm import compute_dtype
from specla.records import path_end


def expand_groups(x: Tensor, num_heads: int) -> Tensor:
    """Repeat group matrices for their heads: ``[B, T, G, N] -> [B, T, H, N]`` (FLA mapping)."""
    return x.repeat_interleave(num_heads // x.shape[2], dim=2)


def discretize(dt_raw: Tensor, dt_bias: Tensor, A_log: Tensor, dt_limit: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """Step size and per-token log decay of Mamba2 (FLA ``Mamba2.torch_forward``).

    Args:
        dt_raw: ``[B, T, H]`` the ``dt`` slice of ``in_proj`` (any float dtype).
        dt_bias, A_log: ``[H]``; dt_limit: ``(min, max)`` clamp of the step size.
    Returns:
        ``dt = clamp(softplus(dt_raw + dt_bias), *dt_limit)`` and ``a = dt * A`` with
        ``A = -exp(A_log)``, both ``[B, T, H]`` in the compute dtype of ``dt_raw``.
    """
    ct = compute_dtype(dt_raw)
    dt = F.softplus(dt_raw.to(ct) + dt_bias.to(ct)).clamp(dt_limit[0], dt_limit[1])
    return dt, dt * -torch.exp(A_log.to(ct))


def tree_ssd(
    x: Tensor, dt: Tensor, a: Tensor, Bm: Tensor, Cm: Tensor, D: Tensor, S0: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree-masked factorized SSD (docs/DESIGN.md section 5; Dao & Gu 2024, arXiv 2405.21060, the
    quadratic "attention" form of SSD with the causal mask replaced by the tree's ancestor mask).

    With ``u = dt * x``, ``G = M_incl @ a`` (log decay summed along each root path) and
    ``Gam[i, j] = exp(G_i - G_j)`` on ancestor pairs only::

        y_i = exp(G_i) S0^T Cm_i + sum_{j on path(i)} Gam[i, j] (Cm_i . Bm_j) u_j + D * x_i

    equals the serial recurrence along each node's root path from ``S0``.

    Args:
        x: ``[B, T, H, P]`` conv outputs (SSM input).
        dt: ``[B, T, H]`` step sizes (after softplus and clamp), float32/float64.
        a: ``[B, T, H]`` log decay ``dt * A`` (<= 0), float32/float64.
        Bm, Cm: ``[B, T, G, N]`` input and output matrices.
        D: ``[H]`` or ``[H, P]`` skip weights.
        S0: ``[B, H, N, P]`` committed state, float32/float64.
        mask: ``[B, T, T]`` bool inclusive-ancestor mask ``M_incl``.
    Returns:
        ``y [B, T, H, P]``, ``u [B, T, H, P]`` (``dt * x``), ``G [B, T, H]``, all in ``S0.dtype``.
    """
    H = x.shape[2]
    ct = S0.dtype
    xh = x.to(ct)
    u = dt.to(ct)[..., None] * xh  # [B, T, H, P]
    bh = expand_groups(Bm, H).to(ct).transpose(1, 2)  # [B, H, T, N]
    ch = expand_groups(Cm, H).to(ct).transpose(1, 2)
    G = torch.einsum("bij,bjh->bhi", mask.to(ct), a.to(ct))  # [B, H, T], path-summed
    # mask the exponent before exp: off-path pairs must be exactly 0, never exp(-G) overflows
    gam = torch.exp(torch.where(mask[:, None], G[..., :, None] - G[..., None, :], float("-inf")))
    y = torch.exp(G)[..., None] * (ch @ S0) + ((ch @ bh.transpose(-1, -2)) * gam) @ u.transpose(1, 2)
    Dh = D.to(ct) if D.dim() == 2 else D.to(ct)[:, None]  # [H, P] or [H, 1]
    y = y.transpose(1, 2) + Dh * xh
    return y, u, G.transpose(1, 2)


def node_states(S0: Tensor, Bm: Tensor, u: Tensor, G: Tensor, mask: Tensor) -> Tensor:
    """State after every node's root path (for the snapshot strategy), from factors.

    Args: as :func:`ssd_commit_factor`, plus ``mask`` ``[B, T, T]`` bool.
    Returns:
        ``[B, T, H, N, P]``: ``exp(G_i) S0 + sum_{j <= i on path} exp(G_i - G_j) Bm_j u_j^T``.
    """
    bh = expand_groups(Bm, u.shape[2]).to(S0.dtype)
    w = torch.exp(torch.where(mask[:, :, None, :], G[:, :, :, None] - G.transpose(1, 2)[:, None], float("-inf")))
    return torch.exp(G)[..., None, None] * S0[:, None] + torch.einsum("bihj,bjhn,bjhp->bihnp", w, bh, u)


def ssd_commit_factor(S0: Tensor, Bm: Tensor, u: Tensor, G: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Closed-form commit of an accepted path from factor records (docs/DESIGN.md sections 4-5):
    ``S_new = exp(G_a) S0 + sum_{j on path(a)} exp(G_a - G_j) Bm_j u_j^T``.

    Args:
        S0: ``[B, H, N, P]`` pre-step state.
        Bm: ``[B, T, G, N]``; u: ``[B, T, H, P]``; G: ``[B, T, H]`` (a :class:`Mamba2FactorRecord`).
        path: ``[B, L]`` int64 root-to-leaf node indices, ``-1`` padded.
        path_len: ``[B]`` int64; ``0`` returns ``S0[b]`` bit-identical.
    Returns:
        ``[B, H, N, P]`` new state, ``S0.dtype``.
    """
    end = path_end(path, path_len)
    H = u.shape[2]
    Ga = G.gather(1, end.clamp(min=0)[:, None, None].expand(-1, 1, H))[:, 0]  # [B, H]
    idx = path.clamp(min=0)
    on = path >= 0
    Gp = G.gather(1, idx[..., None].expand(-1, -1, H))  # [B, L, H]
    bp = expand_groups(Bm.gather(1, idx[..., None, None].expand(-1, -1, *Bm.shape[2:])), H).to(S0.dtype)
    up = u.gather(1, idx[..., None, None].expand(-1, -1, *u.shape[2:]))
    w = torch.exp(torch.where(on[..., None], Ga[:, None] - Gp, float("-inf")))
    S = torch.exp(Ga)[..., None, None] * S0 + torch.einsum("blh,blhn,blhp->bhnp", w, bp, up)
    return torch.where((path_len > 0)[:, None, None, None], S, S0)


def ssd_commit_replay(S0: Tensor, Bm: Tensor, u: Tensor, a: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Token-replay commit: run the serial recurrence ``S = exp(a_t) S + Bm_t u_t^T`` over the
    accepted nodes (FLA-SD style).

    Args: ``S0 [B, H, N, P]``, per-node ``Bm [B, T, G, N]``, ``u [B, T, H, P]``, ``a [B, T, H]``,
        ``path [B, L]``, ``path_len [B]``.
    Returns:
        ``[B, H, N, P]``; sequences with shorter paths stop updating at their end.
    """
    H = u.shape[2]
    S = S0
    rows = torch.arange(S0.shape[0], device=S0.device)
    for t in range(path.shape[1]):
        n = path[:, t].clamp(min=0)
        bt = expand_groups(Bm[rows, n][:, None], H)[:, 0].to(S.dtype)  # [B, H, N]
        ut, at = u[rows, n].to(S.dtype), a[rows, n].to(S.dtype)
        Sn = torch.exp(at)[..., None, None] * S + bt[..., :, None] * ut[..., None, :]
        S = torch.where((t < path_len)[:, None, None, None], Sn, S)
    return S


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool) -> Tensor:
    """FLA's ``RMSNormGated`` (``rms_norm_ref``): RMSNorm over groups of ``group_size`` channels
    with a SiLU gate applied before (``norm_before_gate=False``) or after the norm.

    Args:
        y: ``[..., Di]``; z: ``[..., Di]`` gate; weight: ``[Di]``; eps: float; group_size: divides ``Di``.
    Returns:
        ``[..., Di]`` in the compute dtype of ``y`` (float32, float64 for float64 inputs).
    """
    ct = compute_dtype(y)
    y, z = y.to(ct), F.silu(z.to(ct))
    if not norm_before_gate:
        y = y * z
    g = y.unflatten(-1, (-1, group_size))
    out = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(ct)
    return out * z if norm_before_gate else out
