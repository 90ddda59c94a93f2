"""Standalone closed-form commit kernel (``flush``): applies a pending accepted path to the
recurrent state from its factor records, without verifying anything (end of generation, a switch
to plain decoding, before reading the state). The same code runs fused inside the verify kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .verify import _apply_pending, _check_pending


@triton.jit
def _flush_kernel(S, pk, pdelta, pG, path, path_len, P, Tp,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_S = S + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    _apply_pending(b_S, p_S, m_s, pk, pdelta, pG, path, path_len, i_b, i_h, i_hv, o_k, o_v, m_k, m_v,
                   P, Tp, H, HV, K, V)


def flush_commit(state: Tensor, k: Tensor, delta: Tensor, G: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Closed-form commit, in place: ``S_new = exp(G_a) S0 + sum_{j on path(a)} exp(G_a - G_j)
    k_j Delta_j^T`` (docs/DESIGN.md section 4).

    Args:
        state: ``[B, HV, K, V]`` float32, contiguous; updated in place and returned.
        k: ``[B, T, H, K]``; delta: ``[B, T, HV, V]`` float32; G: ``[B, T, HV]`` float32.
        path: ``[B, P]`` int64 root-to-leaf node indices, ``-1`` padded; path_len: ``[B]`` int64
            (``0`` leaves that sequence's state bit-identical: it is not even written).
    Returns:
        ``state``.
    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    B, HV, K, V = state.shape
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 [B, HV, K, V], got {state.dtype}")
    H = k.shape[2]
    _check_pending(B, H, K, HV, V, (k, delta, G, path, path_len))
    if len({x.device for x in (state, k, delta, G, path, path_len)}) != 1:
        raise ValueError("all tensors must be on one device")
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)
    pk, pd, pG, pa, pl = (x.contiguous() for x in (k, delta, G, path, path_len))
    _flush_kernel[(triton.cdiv(V, BV), B * HV)](state, pk, pd, pG, pa, pl, pa.shape[1], pk.shape[1],
                                                 H=H, HV=HV, K=K, V=V, BK=BK, BV=BV)
    return state
