"""Pure-PyTorch tree-masked GLA operators: the reference path that runs on CPU and GPU.

Batched, factorized forms of docs/DESIGN.md section 5 (no loops over nodes). ``naive.py`` holds the
sequential per-path twins they are tested against; the Triton kernels are tested against the same
twins.

Shapes: ``B`` sequences, ``T`` tree nodes (root-explicit trees have ``T = N + 1``), ``H`` heads
(keys, values and decays already repeated to the query heads, as FLA's layer does for
``num_kv_heads``), ``K``/``V`` head dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specla.ops.norm import compute_dtype
from specla.records import path_end


def _decay(Gk_i: Tensor, Gk_j: Tensor, mask: Tensor) -> Tensor:
    """``exp(Gk_i - Gk_j)`` on ancestor pairs, exactly 0 elsewhere (the exponent is masked before
    ``exp``, so off-path pairs never form ``exp(-Gk)``). Broadcasts over leading dims."""
    return torch.exp(torch.where(mask, Gk_i - Gk_j, float("-inf")))


def tree_gla(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, S0: Tensor, mask: Tensor, scale: float
             ) -> tuple[Tensor, Tensor]:
    """Tree-masked factorized gated linear attention (docs/DESIGN.md section 5).

    Every node's output equals the serial recurrence ``S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)`` run along that node's root path from ``S0``:

        Gk = M_incl @ gk                                                   # [T, K] per head
        O  = (scale q * exp(Gk)) @ S0 + A @ v,
        A[i, j] = sum_c scale q_i[c] k_j[c] exp(Gk_i[c] - Gk_j[c])  for j on path(i), else 0

    Args:
        q, k: ``[B, T, H, K]`` (after the feature map), any float dtype.
        v: ``[B, T, H, V]``.
        gk: ``[B, T, H, K]`` per-channel log decay (<= 0), float32/float64.
        S0: ``[B, H, K, V]`` committed state, float32/float64 (the compute dtype).
        mask: ``[B, T, T]`` bool inclusive-ancestor mask ``M_incl``.
        scale: query scale (``K ** -0.5``, FLA's default).
    Returns:
        ``o [B, T, H, V]`` and ``Gk [B, T, H, K]`` (path-summed log decay: the factor record
        with ``k`` and ``v``), in ``S0.dtype``.
    """
    ct = S0.dtype
    qh, kh, vh, gh = (x.to(ct).transpose(1, 2) for x in (q, k, v, gk))  # [B, H, T, *]
    qh = qh * scale
    Gk = torch.einsum("bij,bhjc->bhic", mask.to(ct), gh)  # path-summed, not a node-order cumsum
    w = _decay(Gk[:, :, :, None], Gk[:, :, None], mask[:, None, :, :, None])  # [B, H, T, T, K]
    A = torch.einsum("bhic,bhjc,bhijc->bhij", qh, kh, w)
    o = (qh * torch.exp(Gk)) @ S0 + A @ vh
    return o.transpose(1, 2), Gk.transpose(1, 2)


def node_states(S0: Tensor, k: Tensor, v: Tensor, Gk: Tensor, mask: Tensor) -> Tensor:
    """State after every node's root path (for the snapshot strategy), from factors.

    Args: as :func:`gla_commit_factor`, plus ``mask`` ``[B, T, T]`` bool.
    Returns:
        ``[B, T, H, K, V]``: ``diag(exp(Gk_i)) S0 + sum_{j <= i on path} diag(exp(Gk_i - Gk_j)) k_j v_j^T``.
    """
    ct = S0.dtype
    w = _decay(Gk[:, :, None], Gk[:, None], mask[:, :, :, None, None])  # [B, Ti, Tj, H, K]
    return torch.exp(Gk)[..., None] * S0[:, None] + torch.einsum("bijhc,bjhc,bjhv->bihcv", w, k.to(ct), v.to(ct))


def gla_commit_factor(S0: Tensor, k: Tensor, v: Tensor, Gk: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Closed-form commit of an accepted path from factor records (docs/DESIGN.md section 5).

    ``S_new = diag(exp(Gk_a)) S0 + sum_{j on path(a)} diag(exp(Gk_a - Gk_j)) k_j v_j^T``.

    Args:
        S0: ``[B, H, K, V]`` pre-step state.
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; Gk: ``[B, T, H, K]`` (a :class:`GLAFactorRecord`).
        path: ``[B, P]`` int64 root-to-leaf node indices, ``-1`` padded.
        path_len: ``[B]`` int64; ``0`` returns ``S0[b]`` bit-identical.
    Returns:
        ``[B, H, K, V]`` new state, ``S0.dtype``.
    """
    ct = S0.dtype
    end = path_end(path, path_len).clamp(min=0)
    gather = lambda x, idx: x.gather(1, idx[:, :, None, None].expand(-1, -1, *x.shape[2:]))  # noqa: E731
    Ga = gather(Gk, end[:, None])  # [B, 1, H, K]
    idx = path.clamp(min=0)
    w = _decay(Ga, gather(Gk, idx), (path >= 0)[:, :, None, None])  # [B, P, H, K]
    S = torch.exp(Ga[:, 0])[..., None] * S0 + torch.einsum("bphc,bphc,bphv->bhcv", w, gather(k, idx).to(ct),
                                                            gather(v, idx).to(ct))
    return torch.where((path_len > 0)[:, None, None, None], S, S0)


def gla_commit_replay(S0: Tensor, k: Tensor, v: Tensor, gk: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Token-replay commit: run the serial recurrence over the accepted nodes (FLA-SD style).

    Args: ``S0 [B, H, K, V]``, per-node ``k``/``gk`` ``[B, T, H, K]``, ``v [B, T, H, V]``,
        ``path [B, P]``, ``path_len [B]``.
    Returns:
        ``[B, H, K, V]``; sequences with shorter paths stop updating at their end.
    """
    S = S0
    rows = torch.arange(S0.shape[0], device=S0.device)
    for t in range(path.shape[1]):
        n = path[:, t].clamp(min=0)
        kt, vt, gt = (x[rows, n].to(S.dtype) for x in (k, v, gk))  # [B, H, *]
        Sn = torch.exp(gt)[..., None] * S + kt[..., :, None] * vt[..., None, :]
        S = torch.where((t < path_len)[:, None, None, None], Sn, S)
    return S
