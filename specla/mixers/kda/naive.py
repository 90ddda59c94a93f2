"""Sequential twins of the KDA operators: the per-channel gated delta rule (Kimi team 2025, "Kimi
Linear"; transformers' ``recurrent_kimi_delta_attention``) run token by token along every node's
root path, and the commit of an accepted path by running its tokens again (the ``replay``
strategy). ``reference.py``'s batched factorized forms are tested against these, and these against
transformers' own recurrence.

Shapes: ``B`` sequences, ``T`` tree nodes (root explicit), ``H`` heads, ``K`` key and ``V`` value
head dims. Per head, the state ``S [K, V]`` follows, for each token (``q, k`` L2-normalised, ``q``
scaled by ``K ** -0.5``, ``g`` the per-key-channel log decay, ``beta`` the write strength)::

    S <- diag(exp(g)) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q
"""

from __future__ import annotations

import torch
from torch import Tensor


def kda_step(S: Tensor, q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor):
    """One token of the recurrence for a batch of states.

    Args:
        S: ``[B, H, K, V]``. q (or ``None``), k: ``[B, H, K]``; v: ``[B, H, V]``; g: ``[B, H, K]``
            log decay; beta: ``[B, H]``. One compute dtype (the state's).
    Returns:
        ``(S', o, delta)``: the new state, ``o = S'^T q`` (``[B, H, V]``, ``None`` without
        ``q``) and the token's write ``delta`` (``[B, H, V]``).
    """
    S = S * g.exp()[..., None]
    delta = (v - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return S, ((S * q[..., None]).sum(-2) if q is not None else None), delta


def kda_tree(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, parents: Tensor):
    """The recurrence along every node's root path from the committed state ``S0``, node by node
    in index order (a parent's index is below its child's, ``-1``: the committed state).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]``; beta: ``[B, T, H]``,
            all in the state's dtype. S0: ``[B, H, K, V]``. parents: ``[B, T]`` int64.
    Returns:
        ``o [B, T, H, V]``, the state after each node ``[B, T, H, K, V]`` and each node's write
        ``delta [B, T, H, V]``.
    """
    B, T = parents.shape
    rows = torch.arange(B, device=parents.device)
    states = S0.new_empty(B, T, *S0.shape[1:])
    outs, deltas = v.new_empty(*v.shape), v.new_empty(*v.shape)
    for t in range(T):  # T <= 64 nodes; each step is batched over sequences and heads
        p = parents[:, t]
        prev = torch.where((p < 0)[:, None, None, None], S0, states[rows, p.clamp(min=0)])
        states[:, t], outs[:, t], deltas[:, t] = kda_step(prev, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
    return outs, states, deltas


def kda_commit_replay(S0: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """The state after the accepted ``path`` (``[B, P]`` node indices, root first, ``-1``
    padded; ``path_len [B]``), by running its tokens through the recurrence again; past a row's
    path the decay is 1 and nothing is written, so ``path_len == 0`` leaves ``S0`` bit-identical.
    Shapes of ``k, v, g, beta`` as in :func:`kda_tree`; returns ``[B, H, K, V]``."""
    B, P = path.shape
    rows = torch.arange(B, device=path.device)
    S = S0
    for i in range(P):
        node = path[:, i].clamp(min=0)
        live = (i < path_len)[:, None]
        g_i = torch.where(live[..., None], g[rows, node], 0.0)
        beta_i = torch.where(live, beta[rows, node], 0.0)
        S_new, _, _ = kda_step(S, None, k[rows, node], v[rows, node], g_i, beta_i)
        S = torch.where(live[..., None, None], S_new, S)
    return S
