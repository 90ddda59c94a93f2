"""Pure-PyTorch tree-masked GDN operators: the reference path that runs on CPU and GPU.

These are the batched, factorized forms of docs/DESIGN.md section 4 (no loops over nodes except to
build masks). ``naive.py`` holds the sequential per-path twins they are tested against; the Triton
kernels are tested against the same twins.

Shapes: ``B`` sequences, ``T`` tree nodes (root-explicit trees have ``T = N + 1``), ``H`` key
heads, ``HV`` value heads (``HV % H == 0``; value head ``hv`` reads key head ``hv // (HV // H)``,
as FLA), ``K``/``V`` head dims, ``D`` channels, ``C`` conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.records import path_end


def expand_heads(x: Tensor, num_v_heads: int) -> Tensor:
    """Repeat key heads for grouped value heads: ``[B, T, H, K] -> [B, T, HV, K]`` (FLA mapping)."""
    return x.repeat_interleave(num_v_heads // x.shape[2], dim=2)


def tree_gdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree-masked factorized gated delta rule (docs/DESIGN.md section 4; SpecLA eq. for verify).

    Every node's output equals the serial recurrence run along that node's root path from ``S0``.

    Args:
        q, k: ``[B, T, H, K]`` L2-normalised (float32/float64).
        v: ``[B, T, HV, V]``.
        g: ``[B, T, HV]`` log decay (<= 0), float32/float64.
        beta: ``[B, T, HV]`` in (0, 2).
        S0: ``[B, HV, K, V]`` committed state, float32/float64.
        mask: ``[B, T, T]`` bool inclusive-ancestor mask ``M_incl``.
        scale: query scale (``K ** -0.5``).
    Returns:
        ``o [B, T, HV, V]``, ``delta [B, T, HV, V]``, ``G [B, T, HV]`` in ``S0.dtype``.
    """
    HV = v.shape[2]
    ct = S0.dtype
    qh = (expand_heads(q, HV).to(ct) * scale).transpose(1, 2)  # [B, HV, T, K]
    kh = expand_heads(k, HV).to(ct).transpose(1, 2)
    vh = v.to(ct).transpose(1, 2)  # [B, HV, T, V]
    gh, bh = g.to(ct).transpose(1, 2), beta.to(ct).transpose(1, 2)  # [B, HV, T]
    m = mask[:, None]  # [B, 1, T, T]
    G = torch.einsum("bij,bhj->bhi", mask.to(ct), gh)  # path-summed, not a node-order cumsum
    # mask the exponent before exp: off-path pairs must be exactly 0, never exp(-G) overflows
    gam = torch.exp(torch.where(m, G[..., :, None] - G[..., None, :], float("-inf")))
    eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
    A = torch.where(m & ~eye, bh[..., :, None] * (kh @ kh.transpose(-1, -2)) * gam, 0.0)
    rhs = bh[..., None] * (vh - torch.exp(G)[..., None] * (kh @ S0))
    I = torch.eye(A.shape[-1], dtype=ct, device=A.device)
    delta = torch.linalg.solve_triangular(I + A, rhs, upper=False, unitriangular=True)
    o = torch.exp(G)[..., None] * (qh @ S0) + ((qh @ kh.transpose(-1, -2)) * gam) @ delta
    return o.transpose(1, 2), delta.transpose(1, 2), G.transpose(1, 2)


def chunk_gdn(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, scale: float, chunk: int = 64
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule over whole sequences (WY form; Yang et al. 2024, arXiv 2412.06464,
    as FLA's ``chunk_gated_delta_rule``): teacher-forced scoring and training, where every token
    of every row is real.

    Within a chunk, ``delta = U - W S_c`` with ``U = (I + A)^-1 (beta v)`` and
    ``W = (I + A)^-1 (beta exp(G) k)`` do not depend on the chunk's initial state ``S_c``, so they
    are computed for all chunks at once; only ``S_{c+1} = exp(G_C) S_c + (exp(G_C - G) k)^T delta_c``
    runs chunk by chunk (three small products per chunk, autograd-friendly).

    Args:
        q, k: ``[B, T, H, K]`` L2-normalised; v: ``[B, T, HV, V]``.
        g: ``[B, T, HV]`` log decay (<= 0); beta: ``[B, T, HV]``.
        S0: ``[B, HV, K, V]`` initial state (float32 or float64: the compute dtype).
        scale: query scale (``K ** -0.5``); chunk: tokens per chunk.
    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]``, both in ``S0.dtype``.
    Equals :func:`tree_gdn` on a chain (tested against ``naive.py``'s sequential recurrence).
    """
    B, T, _, _ = k.shape
    HV = v.shape[2]
    ct = S0.dtype
    pad = (-T) % chunk
    # padded tokens have beta = 0 and g = 0: they leave the state unchanged and are cut from o
    padded = lambda x: F.pad(x.to(ct), (0, 0) * (x.dim() - 2) + (0, pad))  # noqa: E731
    qh, kh = (padded(expand_heads(x, HV)) for x in (q, k))
    vh, gh, bh = padded(v), padded(g), padded(beta)
    n = (T + pad) // chunk
    # [B, HV, n, C, .]: heads first, chunks batched
    split = lambda x: x.transpose(1, 2).reshape(B, HV, n, chunk, *x.shape[3:])  # noqa: E731
    qc, kc, vc = split(qh) * scale, split(kh), split(vh)
    G = split(gh).cumsum(-1)  # [B, HV, n, C], within-chunk path sums
    bc = split(bh)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    gam = torch.exp(torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")))
    A = torch.where(~torch.eye(chunk, dtype=torch.bool, device=k.device),
                    bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * gam, 0.0)
    I = torch.eye(chunk, dtype=ct, device=k.device)
    UW = torch.linalg.solve_triangular(I + A, torch.cat([bc[..., None] * vc, (bc * torch.exp(G))[..., None] * kc], -1),
                                       upper=False, unitriangular=True)
    U, W = UW.split([vc.shape[-1], kc.shape[-1]], -1)
    k_end = torch.exp(G[..., -1:] - G)[..., None] * kc  # decay from each token to the chunk end
    S, states, deltas = S0, [], []
    for c in range(n):
        states.append(S)
        d = U[:, :, c] - W[:, :, c] @ S
        deltas.append(d)
        S = torch.exp(G[:, :, c, -1])[..., None, None] * S + k_end[:, :, c].transpose(-1, -2) @ d
    Sc, delta = torch.stack(states, 2), torch.stack(deltas, 2)  # [B, HV, n, K, V], [B, HV, n, C, V]
    o = torch.exp(G)[..., None] * (qc @ Sc) + ((qc @ kc.transpose(-1, -2)) * gam) @ delta
    o = o.reshape(B, HV, n * chunk, -1)[:, :, :T].transpose(1, 2)
    return o, S


def node_states(S0: Tensor, k: Tensor, delta: Tensor, G: Tensor, mask: Tensor) -> Tensor:
    """State after every node's root path (for the snapshot strategy), from factors.

    Args: as :func:`gdn_commit_factor`, plus ``mask`` ``[B, T, T]`` bool.
    Returns:
        ``[B, T, HV, K, V]``: ``exp(G_i) S0 + sum_{j <= i on path} exp(G_i - G_j) k_j delta_j^T``.
    """
    kh = expand_heads(k, delta.shape[2]).to(S0.dtype)
    w = torch.exp(torch.where(mask[:, :, None, :], G[:, :, :, None] - G.transpose(1, 2)[:, None], float("-inf")))
    return torch.exp(G)[..., None, None] * S0[:, None] + torch.einsum("bihj,bjhk,bjhv->bihkv", w, kh, delta)


def gdn_commit_factor(S0: Tensor, k: Tensor, delta: Tensor, G: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Closed-form commit of an accepted path from factor records (docs/DESIGN.md section 4).

    Args:
        S0: ``[B, HV, K, V]`` pre-step state.
        k: ``[B, T, H, K]``; delta: ``[B, T, HV, V]``; G: ``[B, T, HV]`` (a :class:`GDNFactorRecord`).
        path: ``[B, P]`` int64 root-to-leaf node indices, ``-1`` padded.
        path_len: ``[B]`` int64; ``0`` returns ``S0[b]`` bit-identical.
    Returns:
        ``[B, HV, K, V]`` new state, ``S0.dtype``.
    """
    end = path_end(path, path_len)
    HV = delta.shape[2]
    Ga = G.gather(1, end.clamp(min=0)[:, None, None].expand(-1, 1, HV))[:, 0]  # [B, HV]
    idx = path.clamp(min=0)
    on = path >= 0
    Gp = G.gather(1, idx[..., None].expand(-1, -1, HV))  # [B, P, HV]
    kp = expand_heads(k.gather(1, idx[..., None, None].expand(-1, -1, *k.shape[2:])), HV).to(S0.dtype)
    dp = delta.gather(1, idx[..., None, None].expand(-1, -1, *delta.shape[2:]))
    w = torch.exp(torch.where(on[..., None], Ga[:, None] - Gp, float("-inf")))
    S = torch.exp(Ga)[..., None, None] * S0 + torch.einsum("bph,bphk,bphv->bhkv", w, kp, dp)
    return torch.where((path_len > 0)[:, None, None, None], S, S0)


def gdn_commit_replay(
    S0: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor, path_len: Tensor
) -> Tensor:
    """Token-replay commit: run the serial recurrence over the accepted nodes (FLA-SD style).

    Args: ``S0 [B, HV, K, V]``, per-node ``k [B, T, H, K]``, ``v [B, T, HV, V]``,
        ``g``/``beta`` ``[B, T, HV]``, ``path [B, P]``, ``path_len [B]``.
    Returns:
        ``[B, HV, K, V]``; sequences with shorter paths stop updating at their end.
    """
    HV = v.shape[2]
    S = S0
    rows = torch.arange(S0.shape[0], device=S0.device)
    for t in range(path.shape[1]):
        n = path[:, t].clamp(min=0)
        kt = expand_heads(k[rows, n][:, None], HV)[:, 0].to(S.dtype)  # [B, HV, K]
        vt, gt, bt = (x[rows, n].to(S.dtype) for x in (v, g, beta))
        Sd = torch.exp(gt)[..., None, None] * S
        d = bt[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", Sd, kt))
        Sn = Sd + kt[..., :, None] * d[..., None, :]
        S = torch.where((t < path_len)[:, None, None, None], Sn, S)
    return S
