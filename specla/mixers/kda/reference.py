"""Kimi Delta Attention (KDA) over draft trees, batched and factorized (pure PyTorch, no loops
over nodes): the verify of a whole tree from the committed state and the closed-form commit of
an accepted path from compact per-token factor records. ``naive.py`` holds the token-by-token
twins they are tested against.

KDA is the gated delta rule of docs/DESIGN.md section 4 with GLA's per-key-channel decay (section
5). Per head, with ``q, k`` L2-normalised, ``q`` scaled by ``K ** -0.5``, ``g`` the per-channel log
decay and ``beta`` the write strength, each token does::

    S <- diag(exp(g)) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q

Shapes: ``B`` sequences, ``T`` tree nodes (root explicit), ``H`` heads, ``K`` key and ``V`` value
head dims; ``mask [B, T, T]`` the inclusive-ancestor mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specla.mixers.gla.reference import gla_commit_factor, node_states


def tree_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, mask: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Tree-masked factorized KDA: every node's output and ``delta`` equal the recurrence run
    along its root path from ``S0``. With ``Gk = M_incl @ g`` (the log decay summed along each
    root path, per channel) and ``W[i, j, c] = exp(Gk_i[c] - Gk_j[c])`` on ancestor pairs (the
    exponent masked before ``exp``)::

        A[i, j] = beta_i sum_c k_i[c] k_j[c] W[i, j, c]          for j a strict ancestor of i
        Delta   = (I + A)^{-1} (beta v - beta (exp(Gk) * k) @ S0)   # forward substitution
        O[i]    = (exp(Gk_i) * q_i) @ S0 + sum_{j on path(i)} (sum_c q_i[c] k_j[c] W[i, j, c]) Delta_j

    (the derivation of DESIGN.md section 4 with ``diag(exp(.))`` in place of the scalar decay:
    node ``i``'s state before its own write is ``diag(exp(Gk_i)) S0 + sum_j diag(W[i, j]) k_j
    Delta_j^T`` over its strict ancestors ``j``).

    Args:
        q, k: ``[B, T, H, K]``, q scaled, both L2-normalised. v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` per-channel log decay (<= 0). beta: ``[B, T, H]``.
        S0: ``[B, H, K, V]`` committed state; its dtype (float32/float64) is the compute dtype.
        mask: ``[B, T, T]`` bool.
    Returns:
        ``o [B, T, H, V]``, ``delta [B, T, H, V]`` and ``Gk [B, T, H, K]`` in ``S0.dtype``
        (``k``, ``delta``, ``Gk``: the factor record).
    """
    ct = S0.dtype
    qh, kh, vh, gh = (x.to(ct).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, *]
    bh = beta.to(ct).transpose(1, 2)  # [B, H, T]
    Gk = torch.einsum("bij,bhjc->bhic", mask.to(ct), gh)  # path-summed, not a node-order cumsum
    m = mask[:, None, :, :, None]
    W = torch.exp(torch.where(m, Gk[:, :, :, None] - Gk[:, :, None], float("-inf")))  # [B, H, T, T, K]
    eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
    A = torch.where(mask[:, None] & ~eye, bh[..., None] * torch.einsum("bhic,bhjc,bhijc->bhij", kh, kh, W), 0.0)
    rhs = bh[..., None] * (vh - (torch.exp(Gk) * kh) @ S0)
    I = torch.eye(A.shape[-1], dtype=ct, device=A.device)  # noqa: E741
    delta = torch.linalg.solve_triangular(I + A, rhs, upper=False, unitriangular=True)
    o = (torch.exp(Gk) * qh) @ S0 + torch.einsum("bhic,bhjc,bhijc->bhij", qh, kh, W) @ delta
    return o.transpose(1, 2), delta.transpose(1, 2), Gk.transpose(1, 2)


def kda_node_states(S0: Tensor, k: Tensor, delta: Tensor, Gk: Tensor, mask: Tensor) -> Tensor:
    """The state after every node's root path (the ``snapshot`` strategy), from the factors:
    GLA's :func:`specla.mixers.gla.reference.node_states` with ``delta`` as the written values.
    Returns ``[B, T, H, K, V]`` in ``S0.dtype``."""
    return node_states(S0, k, delta, Gk, mask)


def kda_commit_factor(S0: Tensor, k: Tensor, delta: Tensor, Gk: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Closed-form commit of the accepted path ending at node ``a`` from the factor record::

        S_new = diag(exp(Gk_a)) S0 + sum_{j on path(a)} diag(exp(Gk_a - Gk_j)) k_j delta_j^T

    which is GLA's commit (:func:`specla.mixers.gla.reference.gla_commit_factor`) with ``delta`` as
    the written values: the delta rule's correction is already inside ``delta``.

    Args: ``S0 [B, H, K, V]``; ``k, Gk [B, T, H, K]``, ``delta [B, T, H, V]`` from
        :func:`tree_kda`; ``path [B, P]`` int64 (``-1`` padded), ``path_len [B]``.
    Returns:
        ``[B, H, K, V]``; a row with ``path_len == 0`` is ``S0``'s, bit-identical.
    """
    return gla_commit_factor(S0, k, delta, Gk, path, path_len)
