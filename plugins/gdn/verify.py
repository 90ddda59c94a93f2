"""Triton verify kernels for GDN (docs/DESIGN.md section 4, kernel plan).

``serial_verify``: the state-resident serial verify for chains, with the fused delayed commit.
One program per (sequence, value head, V tile) loads its ``[K, BV]`` state tile once, applies the
pending accepted path of the previous step in closed form from its factor records, writes the
committed state once, then runs the chain's tokens with the tile held in registers, emitting
outputs and the factor records of this step (``Delta`` and the path-summed log decay ``G``).
The state is never written with speculative tokens.

Runs on GPU, and on CPU under ``TRITON_INTERPRET=1`` (how CI tests it against ``naive.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _serial_verify_kernel(
    q, k, v, g, beta, S, o, delta, G, num_nodes,
    pk, pdelta, pG, path, path_len,
    scale, T, P, Tp,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)  # grouped value heads read key head hv // (HV // H), as FLA
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_S = S + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    if HAS_PENDING:
        # fused delayed commit: S = exp(G_a) S + sum_{j on path} exp(G_a - G_j) k_j Delta_j^T
        n_p = tl.load(path_len + i_b)
        if n_p > 0:
            end = tl.load(path + i_b * P + n_p - 1)
            G_a = tl.load(pG + (i_b * Tp + end) * HV + i_hv)
            acc = b_S * tl.exp(G_a)
            for j in range(0, P):
                if j < n_p:
                    node = tl.load(path + i_b * P + j)
                    w = tl.exp(G_a - tl.load(pG + (i_b * Tp + node) * HV + i_hv))
                    b_kp = tl.load(pk + ((i_b * Tp + node) * H + i_h) * K + o_k, mask=m_k, other=0.0)
                    b_dp = tl.load(pdelta + ((i_b * Tp + node) * HV + i_hv) * V + o_v, mask=m_v, other=0.0)
                    acc += w * b_kp.to(tl.float32)[:, None] * b_dp.to(tl.float32)[None, :]
            b_S = acc
            tl.store(p_S, b_S, mask=m_s)  # the committed state, written once
    n = tl.load(num_nodes + i_b)
    b_G = tl.zeros([1], dtype=tl.float32)
    for t in range(0, T):
        i_t = i_b * T + t
        b_q = tl.load(q + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_vv = tl.load(v + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + i_t * HV + i_hv + tl.zeros([1], dtype=tl.int64)).to(tl.float32)
        b_beta = tl.load(beta + i_t * HV + i_hv + tl.zeros([1], dtype=tl.int64)).to(tl.float32)
        valid = t < n
        S_dec = b_S * tl.exp(b_g)[:, None]
        b_d = b_beta * (b_vv - tl.sum(S_dec * b_k[:, None], 0))
        S_new = S_dec + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(S_new * b_q[:, None], 0)
        G_new = b_G + b_g
        b_S = tl.where(valid, S_new, b_S)
        b_G = tl.where(valid, G_new, b_G)
        tl.store(o + (i_t * HV + i_hv) * V + o_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
        tl.store(delta + (i_t * HV + i_hv) * V + o_v, tl.where(valid, b_d, 0.0), mask=m_v)
        if i_v == 0:
            tl.store(G + i_t * HV + i_hv + tl.zeros([1], dtype=tl.int64), tl.where(valid, G_new, 0.0))


def _launch_serial(q, k, v, g, beta, state, num_nodes, scale, pending, out):
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    o, d, G = out
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)
    if pending is None:
        dummy = torch.zeros(1, dtype=torch.int64, device=q.device)
        pk, pd, pG, path, plen, P, Tp = state, state, state, dummy, dummy, 1, 1
    else:
        pk, pd, pG, path, plen = pending
        P, Tp = path.shape[1], pk.shape[1]
    grid = (triton.cdiv(V, BV), B * HV)
    _serial_verify_kernel[grid](
        q, k, v, g, beta, state, o, d, G, num_nodes, pk, pd, pG, path, plen,
        scale, T, P, Tp, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HAS_PENDING=pending is not None,
    )


def serial_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, num_nodes: Tensor,
    scale: float, pending: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """State-resident serial verify of a batch of chains, with the fused delayed commit.

    Node ``t`` of sequence ``b`` is the child of node ``t - 1`` (node 0 hangs from the committed
    state); nodes ``t >= num_nodes[b]`` are padding and get zero outputs.

    Args:
        q, k: ``[B, T, H, K]`` L2-normalised queries/keys (float32 or bfloat16).
        v: ``[B, T, HV, V]`` (float32 or bfloat16); ``HV % H == 0``.
        g: ``[B, T, HV]`` float32 log decay; beta: ``[B, T, HV]`` float32.
        state: ``[B, HV, K, V]`` float32 committed state; the pending commit, if any, is applied
            to it **in place** (and nothing else is written to it).
        num_nodes: ``[B]`` int64 chain length per sequence (``0..T``).
        scale: query scale (``K ** -0.5``).
        pending: the previous step's ``(k [B, Tp, H, K], delta [B, Tp, HV, V] float32,
            G [B, Tp, HV] float32, path [B, P] int64, path_len [B] int64)``; ``path_len[b] = 0``
            leaves sequence ``b``'s state bit-identical.
        out: optional preallocated ``(o, delta, G)`` (tests pass NaN-filled tensors).
    Returns:
        ``o [B, T, HV, V]`` (``v.dtype``), ``delta [B, T, HV, V]`` float32, ``G [B, T, HV]``
        float32: outputs and factor records (``gdn.records.GDNFactorRecord``).
    Raises:
        ValueError: shapes, dtypes or devices disagree (checked before any launch).
    Formula: docs/DESIGN.md section 4 (serial recurrence; closed-form commit).
    """
    B, T, H, K = k.shape
    if q.shape != k.shape or v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, HV, V] with HV % H == 0; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    for name, x, shape in (("g", g, (B, T, HV)), ("beta", beta, (B, T, HV)), ("state", state, (B, HV, K, V))):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {list(x.shape)}")
    if num_nodes.shape != (B,) or num_nodes.dtype != torch.int64:
        raise ValueError(f"num_nodes must be int64 [{B}], got {num_nodes.dtype} {list(num_nodes.shape)}")
    tensors = [q, k, v, g, beta, state, num_nodes] + list(pending or [])
    if len({x.device for x in tensors}) != 1:
        raise ValueError("all tensors must be on one device")
    if pending is not None:
        pk, pd, pG, path, plen = pending
        Tp = pk.shape[1]
        if pk.shape != (B, Tp, H, K) or pd.shape != (B, Tp, HV, V) or pG.shape != (B, Tp, HV) or \
                pd.dtype != torch.float32 or pG.dtype != torch.float32 or path.dim() != 2 or path.shape[0] != B \
                or plen.shape != (B,) or path.dtype != torch.int64 or plen.dtype != torch.int64:
            raise ValueError("pending must be (k [B, Tp, H, K], delta [B, Tp, HV, V] f32, G [B, Tp, HV] f32, "
                             "path [B, P] int64, path_len [B] int64)")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if out is None:
        out = (torch.empty_like(v), torch.empty(B, T, HV, V, dtype=torch.float32, device=v.device),
               torch.empty(B, T, HV, dtype=torch.float32, device=v.device))
    _launch_serial(q, k, v, g, beta, state, num_nodes, scale,
                   None if pending is None else tuple(x.contiguous() for x in pending), out)
    return out
