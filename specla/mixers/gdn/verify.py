"""Triton verify kernels for GDN (docs/DESIGN.md section 4, kernel plan).

``tree_verify``: the tree-masked factorized (parallel) verify for trees of up to 64 nodes.
``serial_verify``: the state-resident serial verify for chains, with the fused delayed commit.
One program per (sequence, value head, V tile) loads its ``[K, BV]`` state tile once, applies the
pending accepted path of the previous step in closed form from its factor records, writes the
committed state once, then runs the chain's tokens with the tile held in registers, emitting
outputs and the factor records of this step (``Delta`` and the path-summed log decay ``G``).
The state is never written with speculative tokens.

Runs on GPU, and on CPU under ``TRITON_INTERPRET=1`` (how CI tests it against ``naive.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from specla.ops.act_triton import softplus
from specla.ops.pending import check_layer_commit, own_slots, pending_launch, with_pending
from specla.ops.tree_triton import PLACEMENT, ancestor_mask_tile, token_rows
from specla.records import LayerCommit

from .records import GDNFactorRecord

# Launch parameters per kernel, chosen at the GDN-1.3B layer shape (K = V = 256); the figures are in
# docs/tuning.md, "GDN verify launch parameters". "BV": the V-tile width (each program keeps a
# [K, BV] float32 state tile in registers: wider tiles spill on the serial and chain kernels).
# "decode": one-token passes (plain decoding) on the serial kernel, in wider tiles on more warps.
# "tree": "tiles" is (BV, BKC) per form of the prepare (the tree kernel visits the state in K
# blocks of BKC rows); "prepare": "auto" runs the prepare inside each verify program (one launch
# fewer a layer) up to 8 nodes at batch 8 or less and up to 16 at batch 1, else as its own kernel;
# "dot": the products' precision where the activations are not float32 (float32 runs take
# "ieee"): the mixer passes q and k in float32, so "ieee" would keep every product off the tensor
# cores, and plain "tf32" rounds them so that a bf16 model's speculative tokens stop matching
# plain decoding's; "tf32x3" keeps float32's accuracy on tensor cores; "commit": the pending
# commit's product, likewise. The top-level "prepare": the warps of the tree's prepare kernel (a
# serial forward substitution, which stays accurate where a Neumann product of powers of A
# cancels catastrophically on deep chains of correlated keys); "inverse": that substitution row
# by row ("serial", one step a node), by blocks of 16 rows on the tensor cores ("blocked", 15 + 2
# (BT / 16 - 1) tile products whatever the node count) or level by level ("levels", one tile
# product a tree level: the rows of one depth depend only on shallower rows); "auto": levels for
# trees, serial for chains (docs/tuning.md, "GDN verify launch parameters").
# benchmarks/kernels.py --only sweep, benchmarks/scripts/gdn_pending_verify.py --sweep and
# benchmarks/engine_kernels.py --tree-inverse time the alternatives.
TUNING = {"serial": {"BV": 8, "num_warps": 1}, "decode": {"BV": 32, "num_warps": 4},
          "chain": {"BV": 16, "num_warps": 1},
          "tree": {"tiles": {"separate": (64, 32), "fused": (32, 64)}, "num_warps": 4, "num_stages": 3,
                   "prepare": "auto", "dot": "tf32x3", "commit": "tf32x3", "inverse": "auto"},
          "prepare": {"num_warps": 2}}
INVERSE_FORMS = ("serial", "blocked", "levels")  # TUNING["tree"]["inverse"], by the kernels' INVERSE


@triton.jit
def _apply_pending(b_S, p_S, m_s, pk, pdelta, pG, path, path_len, i_b, i_r, off, i_h, i_hv, o_k, o_v, m_k, m_v,
                   P, Tp, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Fused delayed commit of one state tile: S = exp(G_a) S + sum_{j on path} exp(G_a - G_j)
    k_j Delta_j^T, written back once (where ``m_s``); an empty path leaves the tile (and memory)
    untouched. Sequence ``i_b``'s path entries less ``off`` are node indices into its records' row
    ``i_r``."""
    n_p = tl.load(path_len + i_b)
    if n_p > 0:
        end = tl.load(path + i_b * P + n_p - 1) - off
        G_a = tl.load(pG + (i_r * Tp + end) * HV + i_hv)
        acc = b_S * tl.exp(G_a)
        for j in range(0, P):
            if j < n_p:
                node = tl.load(path + i_b * P + j) - off
                w = tl.exp(G_a - tl.load(pG + (i_r * Tp + node) * HV + i_hv))
                b_kp = tl.load(pk + ((i_r * Tp + node) * H + i_h) * K + o_k, mask=m_k, other=0.0)
                b_dp = tl.load(pdelta + ((i_r * Tp + node) * HV + i_hv) * V + o_v, mask=m_v, other=0.0)
                acc += w * b_kp.to(tl.float32)[:, None] * b_dp.to(tl.float32)[None, :]
        b_S = acc
        tl.store(p_S, b_S, mask=m_s)
    return b_S


PENDING_FIELDS = dict(pk="k", pdelta="delta", pG="G")  # kernel parameter -> GDNFactorRecord field
# the serial kernel's state-stride and layer-stride parameters (specla.ops.pending.own_slots)
SLOT_PARAMS = dict(strides=("sS_b", "sS_h", "sS_k", "sS_v"), layers=("lS", "lk", "ld", "lG"))


@with_pending
@triton.heuristics({"ONE": lambda args: args["T"] == 1,  # one token: plain decoding's pass
                    "SLOTS": lambda args: args["state_idx"] is not None})
@triton.jit
def _serial_verify_kernel(
    q, k, v, g, beta, S, o, delta, G, num_nodes,
    pk, pdelta, pG, path, path_len, state_idx, rec_idx,
    scale, T, P, Tp, SV, sS_b, sS_h, sS_k, sS_v, path_step, lS, lk, ld, lG,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr, ONE: tl.constexpr, SLOTS: tl.constexpr,
):
    """Per (sequence, value head, V tile[, layer]): the pending commit, then the chain's tokens.
    The state of sequence ``b`` lies at slot ``b``, or ``state_idx[b]`` (``SLOTS``; a negative
    slot is neither read nor written), element ``(hv, k, v)`` at ``hv sS_h + k sS_k + v sS_v``;
    its pending records at row ``b``, or ``rec_idx[b]``, node ``path[b, j] - b * path_step``.
    A third grid axis runs one commit per layer (``T = 0``): layer ``l``'s state and records
    lie ``l lS``, ``l lk``, ``l ld``, ``l lG`` elements on."""
    i_v, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    S += i_l * lS
    if HAS_PENDING:
        pk += i_l * lk
        pdelta += i_l * ld
        pG += i_l * lG
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)  # grouped value heads read key head hv // (HV // H), as FLA
    if SLOTS:
        slot = tl.load(state_idx + i_b).to(tl.int64)
        i_r = tl.load(rec_idx + i_b).to(tl.int64)
    else:
        slot, i_r = i_b, i_b
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :] & (slot >= tl.zeros([1, BV], dtype=tl.int64))
    p_S = S + slot * sS_b + i_hv * sS_h + o_k[:, None] * sS_k + o_v[None, :] * sS_v
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    if HAS_PENDING:  # fused delayed commit: the committed state is written once
        b_S = _apply_pending(b_S, p_S, m_s, pk, pdelta, pG, path, path_len, i_b, i_r, i_b * path_step, i_h, i_hv,
                             o_k, o_v, m_k, m_v, P, Tp, H, HV, K, V)
    n = tl.load(num_nodes + i_b)
    if ONE:  # one token (plain decoding): o = exp(g) q.S + (q.k) delta; no new state tile is formed
        b_q = tl.load(q + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + (i_b * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_vv = tl.load(v + i_b * SV + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + i_b * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + i_b * HV + i_hv).to(tl.float32)
        e_g = tl.exp(b_g)
        b_d = b_beta * (b_vv - e_g * tl.sum(b_S * b_k[:, None], 0))
        b_o = e_g * tl.sum(b_S * b_q[:, None], 0) + tl.sum(b_q * b_k, 0) * b_d
        valid = n > 0
        tl.store(o + (i_b * HV + i_hv) * V + o_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
        tl.store(delta + (i_b * HV + i_hv) * V + o_v, tl.where(valid, b_d, 0.0), mask=m_v)
        if i_v == 0:
            tl.store(G + i_b * HV + i_hv, tl.where(valid, b_g, 0.0))
    else:
        b_G = tl.zeros([1], dtype=tl.float32)
        for t in range(0, T):
            i_t = i_b * T + t
            b_q = tl.load(q + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
            b_k = tl.load(k + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_vv = tl.load(v + i_t * SV + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
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
    v, SV = _value_rows(v)
    o, d, G = out
    BK = triton.next_power_of_2(K)
    tune = TUNING["decode" if T == 1 else "serial"]
    BV = min(triton.next_power_of_2(V), tune["BV"])
    _serial_verify_kernel[(B * HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, state, o, d, G, num_nodes, scale=scale, T=T, SV=SV, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        **_pending_kwargs(pending), **own_slots(state, **SLOT_PARAMS), num_warps=tune["num_warps"],
    )


def serial_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, num_nodes: Tensor,
    scale: float, pending: LayerCommit | None = None,
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
        pending: the previous step's commit, :class:`specla.records.LayerCommit` of a
            ``GDNFactorRecord`` (``k [B, Tp, H, K]``, ``delta [B, Tp, HV, V]`` float32, ``G [B,
            Tp, HV]`` float32), ``path [B, P]`` and ``path_len [B]`` int64; ``path_len[b] = 0``
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
    _check(q, k, v, g, beta, state, pending)
    if num_nodes.shape != (B,) or num_nodes.dtype != torch.int64 or num_nodes.device != k.device:
        raise ValueError(f"num_nodes must be int64 [{B}] on {k.device}, got {num_nodes.dtype} {list(num_nodes.shape)}")
    HV, V = v.shape[2], v.shape[3]
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    if out is None:
        out = (torch.empty(v.shape, dtype=v.dtype, device=v.device),
               torch.empty(B, T, HV, V, dtype=torch.float32, device=v.device),
               torch.empty(B, T, HV, dtype=torch.float32, device=v.device))
    _launch_serial(q, k, v, g, beta, state, num_nodes, scale, pending, out)
    return out


def _value_rows(v: Tensor) -> tuple[Tensor, int]:
    """``v [B, T, HV, V]`` as the serial and tree kernels read it, with its token stride: heads and
    channels dense, one stride per token. The values are a slice of a wider per-token projection
    (after the short conv), which needs no copy; anything else is made contiguous."""
    B, T, HV, V = v.shape
    if v.stride(3) == 1 and v.stride(2) == V:
        if T == 1:  # token b is row b: the batch stride (a size-1 dim's stride says nothing)
            return v, v.stride(0)
        if B <= 1 or v.stride(0) == T * v.stride(1):
            return v, v.stride(1)
    return v.contiguous(), HV * V


def _check(q, k, v, g, beta, state, pending) -> None:
    """Shapes, dtypes and devices shared by the verify kernels (raises ValueError)."""
    B, T, H, K = k.shape
    if q.shape != k.shape or v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, HV, V] with HV % H == 0; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    for name, x, shape in (("g", g, (B, T, HV)), ("beta", beta, (B, T, HV)), ("state", state, (B, HV, K, V))):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {list(x.shape)}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (the committed state is written in place)")
    if len({x.device for x in [q, k, v, g, beta, state, *(pending.tensors() if pending else [])]}) != 1:
        raise ValueError("all tensors must be on one device")
    if pending is not None:
        _check_pending(B, H, K, HV, V, pending)


def _check_pending(B, H, K, HV, V, pending: LayerCommit) -> None:
    """A pending commit's factor records and path must match the state's shape (ValueError)."""
    check_layer_commit(pending, GDNFactorRecord, B, dict(k=(H, K), delta=(HV, V), G=(HV,)), float32=("delta", "G"))


def _pending_kwargs(pending: LayerCommit | None) -> dict:
    """The launch's keyword arguments of an optional pending commit (:mod:`specla.ops.pending`)."""
    return pending_launch(pending, PENDING_FIELDS)


@triton.jit
def _tree_inverse(b_kk, b_M, b_g, b_beta, o_t, n, BT: tl.constexpr, DOT_PREC: tl.constexpr, INVERSE: tl.constexpr):
    """``(T, G)`` of one (sequence, value head) from ``k k^T [BT, BT]``, the inclusive-ancestor
    mask ``[BT, BT]``, the log decays and betas ``[BT]``: ``G = M_incl @ g`` and ``T = (I +
    A)^{-1}`` with ``A = strict_M * beta_i (k_i . k_j) exp(G_i - G_j)`` (strictly lower
    triangular: a parent precedes its children), by forward substitution (a serial form: a
    Neumann product of powers of A cancels catastrophically on deep chains of correlated keys),
    ``INVERSE`` (:data:`INVERSE_FORMS`) choosing the order: row by row over the ``n`` nodes
    (0); grouped by blocks of 16 rows (1): the rows of equal offset in every diagonal block at
    once (15 products), then each block row's off-diagonal part from the rows above, ``T_IJ =
    -T_II sum_K A_IK T_KJ`` (two products a block row); or level by level (2): row ``i`` is
    ``e_i - sum_j A_ij T_j`` over its strict ancestors ``j``, all shallower, so every row of
    depth ``d`` follows at once from the rows above it (one product a level: the tree's depth,
    not its node count, sets the steps). Products are ``[BT, BT]`` tiles in ``DOT_PREC``."""
    b_G = tl.sum(tl.where(b_M, b_g[None, :], 0.0), 1)  # path-summed log decay, not a cumsum
    diff = tl.where(b_M, b_G[:, None] - b_G[None, :], 0.0)  # masked before exp
    strict = b_M & (o_t[:, None] != o_t[None, :])
    b_A = tl.where(strict, b_beta[:, None] * b_kk * tl.exp(diff), 0.0)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    if INVERSE == 2:
        depth = tl.sum(b_M.to(tl.int32), 1)  # ancestors, itself included (0 past the nodes)
        b_T = eye
        for d in range(2, tl.max(depth, 0) + 1):  # depth-1 rows have no ancestor: e_i
            rows = depth == d
            upd = tl.dot(tl.where(rows[:, None], b_A, 0.0), b_T, input_precision=DOT_PREC)
            b_T = tl.where(rows[:, None], eye - upd, b_T)
    elif INVERSE == 1:
        same = (o_t[:, None] // 16) == (o_t[None, :] // 16)
        b_Ad = tl.where(same, b_A, 0.0)
        b_D = eye  # the diagonal blocks' inverses
        for i in range(1, 16):
            rows = (o_t % 16) == i
            upd = tl.dot(tl.where(rows[:, None], b_Ad, 0.0), b_D, input_precision=DOT_PREC)
            b_D = tl.where(rows[:, None], eye - upd, b_D)
        b_T = b_D
        for blk in range(1, BT // 16):
            rows = (o_t // 16) == blk
            b_X = tl.dot(tl.where(rows[:, None] & (o_t[None, :] < blk * 16), b_A, 0.0), b_T, input_precision=DOT_PREC)
            b_T -= tl.dot(tl.where(rows[:, None] & same, b_D, 0.0), b_X, input_precision=DOT_PREC)
    else:
        b_T = eye
        for i in range(1, n):
            a_i = tl.sum(tl.where(o_t[:, None] == i, b_A, 0.0), 0)  # row i of A
            row = tl.where(o_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * b_T, 0)
            b_T = tl.where(o_t[:, None] == i, row[None, :], b_T)
    return b_T, b_G


_PLACEMENT = {**PLACEMENT, "RAW_GATES": lambda args: args["A_log"] is not None}
"""Heuristics of the tree kernels' data placement (:func:`_tree_verify_kernel`)."""


@triton.jit
def _gates(g, beta, A_log, dt_bias, tok, SG, i_hv, m_t, RAW_GATES: tl.constexpr):
    """Log decays and betas ``[BT]`` of tokens ``tok`` (rows ``SG`` apart; zero where not
    ``m_t``): given, or from the raw ``a``, ``b`` in their place (``RAW_GATES``: ``g = -exp(A_log)
    softplus(a + dt_bias)``, ``beta = sigmoid(b)``, in float32)."""
    b_g = tl.load(g + tok * SG + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * SG + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if RAW_GATES:
        x = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
        b_g = tl.where(m_t, -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus(x), 0.0)
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    return b_g, b_beta


@triton.heuristics(_PLACEMENT)
@triton.jit
def _tree_prepare_kernel(k, g, beta, mask, Tm, G, cu_seqlens, parents, rec_idx, A_log, dt_bias, T, SQK, SG, D, sP,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKC: tl.constexpr,
                         DOT_PREC: tl.constexpr, VARLEN: tl.constexpr, RAW_GATES: tl.constexpr, ANC: tl.constexpr,
                         L2NORM: tl.constexpr, INVERSE: tl.constexpr):
    """Per (sequence, value head): ``T`` and ``G`` (:func:`_tree_inverse`) once, for all V tiles
    of a separate verify launch. ``k k^T`` accumulates over K in blocks of ``BKC`` (a whole
    [BT, 256] tile would spill). Data placement as :func:`_tree_verify_kernel`'s."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    bos, n = token_rows(cu_seqlens, i_b, T, VARLEN)
    row = i_b
    if rec_idx is not None:
        row = tl.load(rec_idx + i_b).to(tl.int64)
    m_t = o_t < n
    tok = bos + o_t
    m_rec = m_t & (row >= tl.zeros([BT], dtype=tl.int64))  # a scalar mask would not broadcast
    b_M = ancestor_mask_tile(mask, parents, i_b, T, sP, o_t, m_t, ANC)
    b_g, b_beta = _gates(g, beta, A_log, dt_bias, tok, SG, i_hv, m_t, RAW_GATES)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    ssq_k = tl.zeros([BT], dtype=tl.float32)
    for kb in range(0, K, BKC):
        o_k = kb + tl.arange(0, BKC)
        b_k = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K),
                      other=0.0)
        b_k = b_k.to(tl.float32)  # float32 from the mixer, or bf16 (exact in float32)
        if L2NORM:
            ssq_k += tl.sum(b_k * b_k, 1)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    if L2NORM:
        r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
        b_kk = b_kk * r_k[:, None] * r_k[None, :]
    b_T, b_G = _tree_inverse(b_kk, b_M, b_g, b_beta, o_t, n, BT, DOT_PREC, INVERSE)
    tl.store(Tm + i_bh * BT * BT + o_t[:, None] * BT + o_t[None, :], b_T)
    tl.store(G + (row * D + o_t) * HV + i_hv, b_G, mask=m_rec)


@with_pending
@triton.heuristics({"PREPARE": lambda args: args["Tm"] is None,  # no prepare launch's results to load
                    "SLOTS": lambda args: args["state_idx"] is not None, **_PLACEMENT})
@triton.jit
def _tree_verify_kernel(
    q, k, v, g, beta, mask, Tm, G, S, o, delta,
    pk, pdelta, pG, path, path_len,
    cu_seqlens, parents, state_idx, rec_idx, A_log, dt_bias, rk,
    scale, T, P, Tp, SV, SQK, SG, D, sP, sS_b, sS_h, sS_k, sS_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr, DOT_PREC: tl.constexpr,
    COMMIT_PREC: tl.constexpr, BP: tl.constexpr, PREPARE: tl.constexpr, VARLEN: tl.constexpr,
    SLOTS: tl.constexpr, RAW_GATES: tl.constexpr, ANC: tl.constexpr, L2NORM: tl.constexpr, INVERSE: tl.constexpr,
):
    """Per (sequence, value head, V tile): fused delayed commit, then the tree-masked factorized
    verify: Delta = T (beta v - beta exp(G) k S0), O = exp(G) q S0 + ((q k^T) * Gam) Delta.
    The state tile is visited in K blocks of ``BKC`` rows: each block is committed (one product
    ``K_p^T (w Delta_p)`` of the accepted path's keys with its weighted ``Delta`` rows, which are
    loaded once per program; in ``COMMIT_PREC``, "ieee" or "tf32x3", both of float32's accuracy,
    so that the committed state is not rounded to TF32) and written once, then contributes to
    ``k S0``, ``q S0`` and ``q k^T``; nothing larger than a ``[BT, BKC]`` or ``[BKC, BV]`` tile is
    live at a time. Without ``Tm`` (``PREPARE``)
    each program also computes ``T`` and ``G`` (:func:`_tree_inverse`; ``k k^T`` in the same K
    loop) instead of loading them from :func:`_tree_prepare_kernel`'s launch, and the first V
    tile writes ``G``.

    Where the data lives (specla's own calls use the first of each pair): tokens of sequence
    ``b`` at rows ``b * T + t`` or packed at ``cu_seqlens[b] + t`` (``VARLEN``; ``n`` tokens,
    ``n <= BT``); the state of sequence ``b`` at slot ``b`` or ``state_idx[b]`` (``SLOTS``; a
    negative slot reads a zero state), element ``(hv, k, v)`` at ``hv sS_h + k sS_k + v sS_v``;
    the records ``delta``, ``G`` (and the keys ``rk``, when given) of node ``t`` at row
    ``r * D + t``, ``r = b`` or ``rec_idx[b]`` (a negative row writes none); gates ``g``,
    ``beta`` given, or formed from the raw ``a``, ``b`` in their place (``RAW_GATES``: ``g =
    -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``); ``L2NORM``: q and k are
    L2-normalised here (sums of squares gathered over the K blocks, the products rescaled after)."""
    i_v, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    bos, n = token_rows(cu_seqlens, i_b, T, VARLEN)
    if SLOTS:
        slot = tl.load(state_idx + i_b).to(tl.int64)
        row = tl.load(rec_idx + i_b).to(tl.int64)
    else:
        slot, row = i_b, i_b
    m_t, m_v = o_t < n, o_v < V
    tok = bos + o_t
    rec = row * D + o_t
    m_rec = m_t & (row >= tl.zeros([BT], dtype=tl.int64))  # a scalar mask would not broadcast
    b_kS = tl.zeros([BT, BV], dtype=tl.float32)
    b_qS = tl.zeros([BT, BV], dtype=tl.float32)
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    ssq_q = tl.zeros([BT], dtype=tl.float32)
    ssq_k = tl.zeros([BT], dtype=tl.float32)
    if HAS_PENDING:
        # the pending commit as one product per K block: S = exp(G_a) S + K_p^T (w * Delta_p), with
        # the path's weighted Delta rows [BP, BV] loaded once (they do not depend on the K block)
        n_p = tl.load(path_len + i_b)
        o_p = tl.arange(0, BP)
        m_p = o_p < n_p
        nodes = tl.load(path + i_b * P + o_p, mask=m_p & (o_p < P), other=0)
        end = tl.maximum(tl.load(path + i_b * P + tl.maximum(n_p - 1, 0)), 0)  # -1 padded when n_p = 0
        G_a = tl.load(pG + (i_b * Tp + end) * HV + i_hv)
        w = tl.where(m_p, tl.exp(G_a - tl.load(pG + (i_b * Tp + nodes) * HV + i_hv, mask=m_p, other=0.0)), 0.0)
        b_dp = tl.load(pdelta + ((i_b * Tp + nodes[:, None]) * HV + i_hv) * V + o_v[None, :],
                       mask=m_p[:, None] & m_v[None, :], other=0.0).to(tl.float32) * w[:, None]
        decay = tl.where(n_p > 0, tl.exp(G_a), 1.0)  # an empty path: S * 1 + 0, and nothing stored
    for kb in range(0, K, BKC):
        o_k = kb + tl.arange(0, BKC)
        m_k = o_k < K
        m_s = m_k[:, None] & m_v[None, :] & (slot >= tl.zeros([1, BV], dtype=tl.int64))
        p_S = S + slot * sS_b + i_hv * sS_h + o_k[:, None] * sS_k + o_v[None, :] * sS_v
        b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
        if HAS_PENDING:  # no branch on n_p: after a decoder's first step every sequence commits
            b_kp = tl.load(pk + ((i_b * Tp + nodes[None, :]) * H + i_h) * K + o_k[:, None],
                           mask=m_k[:, None] & m_p[None, :], other=0.0).to(tl.float32)
            # COMMIT_PREC keeps float32's accuracy: the committed state must not drift from plain
            # decoding's (TF32 would round Delta)
            b_S = tl.dot(b_kp, b_dp, b_S * decay, input_precision=COMMIT_PREC)
            tl.store(p_S, b_S, mask=m_s & (n_p > tl.zeros([BKC, 1], dtype=tl.int32)))
        m_tk = m_t[:, None] & m_k[None, :]
        # products in DOT_PREC: "ieee" for float32 runs, TUNING["tree"]["dot"] otherwise
        b_q = tl.load(q + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        if L2NORM:
            ssq_q += tl.sum(b_q * b_q, 1)
            ssq_k += tl.sum(b_k * b_k, 1)
        b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
        if PREPARE:
            b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
        b_kS += tl.dot(b_k, b_S, input_precision=DOT_PREC)
        b_qS += tl.dot(b_q, b_S, input_precision=DOT_PREC)
    r_k = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:  # every product above is linear in each q and k row: normalise them now
        r_q = 1.0 / tl.sqrt(ssq_q + 1e-6)
        r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
        b_qk = b_qk * r_q[:, None] * r_k[None, :]
        b_kk = b_kk * r_k[:, None] * r_k[None, :]
        b_kS = b_kS * r_k[:, None]
        b_qS = b_qS * r_q[:, None]
    if rk is not None:  # the records' keys, normalised, from one program per key head
        if (i_v == 0) & (i_hv % (HV // H) == 0):
            for kb in range(0, K, BKC):
                o_k = kb + tl.arange(0, BKC)
                m_tk = m_rec[:, None] & (o_k[None, :] < K)
                b_k = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
                tl.store(rk + (rec[:, None] * H + i_h) * K + o_k[None, :], b_k * r_k[:, None], mask=m_tk)
    b_v = tl.load(v + tok[:, None] * SV + i_hv * V + o_v[None, :],
                  mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_g, b_beta = _gates(g, beta, A_log, dt_bias, tok, SG, i_hv, m_t, RAW_GATES)
    b_M = ancestor_mask_tile(mask, parents, i_b, T, sP, o_t, m_t, ANC)
    if PREPARE:
        b_T, b_G = _tree_inverse(b_kk, b_M, b_g, b_beta, o_t, n, BT, DOT_PREC, INVERSE)
        if i_v == 0:
            tl.store(G + rec * HV + i_hv, b_G, mask=m_rec)
    else:
        b_G = tl.load(G + rec * HV + i_hv, mask=m_rec, other=0.0)
        b_T = tl.load(Tm + i_bh * BT * BT + o_t[:, None] * BT + o_t[None, :])
    eG = tl.exp(b_G)
    rhs = b_beta[:, None] * (b_v - eG[:, None] * b_kS)
    b_d = tl.dot(b_T, rhs, input_precision=DOT_PREC)
    gam = tl.where(b_M, tl.exp(tl.where(b_M, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_o = scale * (eG[:, None] * b_qS + tl.dot(b_qk * gam, b_d, input_precision=DOT_PREC))
    m_tv = m_t[:, None] & m_v[None, :]
    tl.store(o + (tok[:, None] * HV + i_hv) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    tl.store(delta + (rec[:, None] * HV + i_hv) * V + o_v[None, :], b_d, mask=m_rec[:, None] & m_v[None, :])


MAX_TREE_NODES = 64  # register tiles of [BT, BT]; larger trees need the hybrid kernel


def tree_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, mask: Tensor, scale: float,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree-masked factorized (parallel) verify of a batch of trees, with the fused delayed commit.

    Args:
        q, k, v, g, beta, state, scale, pending, out: as :func:`serial_verify`.
        mask: ``[B, T, T]`` bool inclusive-ancestor mask (``specla.tree.inclusive_ancestor_mask``),
            ``T <= 64``.
    Returns:
        ``o [B, T, HV, V]`` (``v.dtype``), ``delta [B, T, HV, V]`` float32, ``G [B, T, HV]``
        float32, every node as if its root path had been decoded serially from the committed
        state.
    Raises:
        ValueError: shapes, dtypes, devices disagree, or ``T > 64``.
    Formula: docs/DESIGN.md section 4 (tree-masked factorized form); ``A`` and ``T = (I + A)^-1``
    are computed once per (sequence, head) by a first kernel and shared by all V tiles, or at
    small batch inside each verify program (``TUNING["tree"]["prepare"]``). Products in float32
    ("ieee") where ``v`` is float32, else in ``TUNING["tree"]["dot"]`` for the verify and
    ``TUNING["tree"]["commit"]`` for the pending commit (TF32x3 for both by default: float32
    accuracy on tensor cores).
    """
    B, T, H, K = k.shape
    _check(q, k, v, g, beta, state, pending)
    if mask.shape != (B, T, T) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{B}, {T}, {T}], got {mask.dtype} {list(mask.shape)}")
    if T > MAX_TREE_NODES:
        raise ValueError(f"tree_verify handles at most {MAX_TREE_NODES} nodes, got {T}")
    HV, V = v.shape[2], v.shape[3]
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    v, SV = _value_rows(v)
    mask = mask.contiguous()  # bool: the kernels load it as int1 (no int8 copy per layer)
    if out is None:
        out = (torch.empty(v.shape, dtype=v.dtype, device=v.device),
               torch.empty(B, T, HV, V, dtype=torch.float32, device=v.device),
               torch.empty(B, T, HV, dtype=torch.float32, device=v.device))
    _launch_tree(B, T, q, k, v, g, beta, state, out, scale, mask=mask, T=T, SV=SV, SQK=H * K, SG=HV, D=T,
                 pending=pending)
    return out


def _launch_tree(B, steps, q, k, v, g, beta, state, out, scale, *, pending=None, state_strides=None, **where):
    """The tree verify of ``B`` sequences of at most ``steps`` nodes: :func:`_tree_verify_kernel`,
    after :func:`_tree_prepare_kernel` where the prepare runs separately (``TUNING``). ``out`` is
    ``(o, delta, G)``; ``where`` gives the kernels' data-placement arguments (``mask``/``parents``,
    ``cu_seqlens``, ``state_idx``, ``rec_idx``, ``A_log``/``dt_bias``, ``rk``, ``L2NORM``, the
    strides and sizes); those left out are specla's own layout; ``state_strides`` (slot, head,
    k, v) defaults to ``state``'s. Products in float32 ("ieee") where ``v`` is float32, else in
    ``TUNING["tree"]["dot"]`` and ``["commit"]``."""
    H, K = k.shape[-2], k.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    o, d, G = out
    BT = max(16, triton.next_power_of_2(steps))
    tune = TUNING["tree"]
    form = tune["prepare"]
    fused = form == "fused" or (form == "auto" and ((steps <= 8 and B <= 8) or (steps <= 16 and B == 1)))
    BV, BKC = tune["tiles"]["fused" if fused else "separate"]
    BKC = max(16, min(triton.next_power_of_2(K), BKC))
    BV = max(16, min(triton.next_power_of_2(V), BV))
    # the activations' dtype decides, not q's (the mixer's q and k are float32 in every run)
    prec, commit = ("ieee", "ieee") if v.dtype == torch.float32 else (tune["dot"], tune["commit"])
    where = dict(mask=None, cu_seqlens=None, parents=None, state_idx=None, rec_idx=None, A_log=None, dt_bias=None,
                 rk=None, sP=0, L2NORM=False) | where
    form = tune["inverse"]
    if form not in ("auto", *INVERSE_FORMS):
        raise ValueError(f'TUNING["tree"]["inverse"] must be one of {", ".join(map(repr, ("auto", *INVERSE_FORMS)))}, '
                         f'got {form!r}')
    if form == "auto":  # a chain has as many levels as nodes, and the serial steps are the cheaper
        form = "serial" if where["mask"] is None and where["parents"] is None else "levels"
    inverse = INVERSE_FORMS.index(form)
    Tm = None if fused else torch.empty(B * HV, BT, BT, dtype=torch.float32, device=v.device)
    if not fused:
        prep = {name: where[name] for name in ("mask", "cu_seqlens", "parents", "rec_idx", "A_log", "dt_bias", "T",
                                               "SQK", "SG", "D", "sP", "L2NORM")}
        _tree_prepare_kernel[(B * HV,)](k=k, g=g, beta=beta, Tm=Tm, G=G, H=H, HV=HV, K=K, BT=BT, BKC=BKC,
                                        DOT_PREC=prec, INVERSE=inverse, **prep, num_warps=TUNING["prepare"]["num_warps"])
    pend = _pending_kwargs(pending)
    sS = state_strides if state_strides is not None else state.stride()
    _tree_verify_kernel[(B * HV, triton.cdiv(V, BV))](
        q=q, k=k, v=v, g=g, beta=beta, Tm=Tm, G=G, S=state, o=o, delta=d, scale=scale, sS_b=sS[0], sS_h=sS[1],
        sS_k=sS[2], sS_v=sS[3], H=H, HV=HV, K=K, V=V, BT=BT, BKC=BKC, BV=BV, DOT_PREC=prec, COMMIT_PREC=commit,
        BP=max(16, triton.next_power_of_2(pend["P"])), INVERSE=inverse, **pend, **where, num_warps=tune["num_warps"],
        num_stages=tune["num_stages"],
    )


@with_pending
@triton.jit
def _chain_kernel(
    q, k, v, g, beta, S, o, delta, G, branch,
    chain_seq, chain_nodes, chain_len, chain_parent, chain_src, slot_of,
    pk, pdelta, pG, path, path_len,
    scale, T, L, P, Tp,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr,
):
    """One chain of a heavy-light decomposition, state tile resident: starts from the committed
    state (the root chain, which also applies the pending commit) or from its branch point's
    materialised state; stores the state after every branch point it passes."""
    i_v, i_ch = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_c, i_hv = i_ch // HV, i_ch % HV
    i_b = tl.load(chain_seq + i_c).to(tl.int64)
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    tile = o_k[:, None] * V + o_v[None, :]
    src = tl.load(chain_src + i_c)
    parent = tl.load(chain_parent + i_c)
    p_S = S + (i_b * HV + i_hv) * K * V + tile
    if src < 0:
        b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
        if HAS_PENDING:  # only the root chain of a sequence reads the committed state
            b_S = _apply_pending(b_S, p_S, m_s, pk, pdelta, pG, path, path_len, i_b, i_b, 0, i_h, i_hv, o_k, o_v,
                                 m_k, m_v, P, Tp, H, HV, K, V)
    else:
        b_S = tl.load(branch + (src * HV + i_hv) * K * V + tile, mask=m_s, other=0.0)
    b_G = tl.zeros([1], dtype=tl.float32)
    if parent >= 0:
        b_G += tl.load(G + (i_b * T + parent) * HV + i_hv)
    n = tl.load(chain_len + i_c)
    for j in range(0, L):
        if j < n:
            node = tl.load(chain_nodes + i_c * L + j).to(tl.int64)
            i_t = i_b * T + node
            b_q = tl.load(q + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
            b_k = tl.load(k + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_vv = tl.load(v + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(g + i_t * HV + i_hv).to(tl.float32)
            b_beta = tl.load(beta + i_t * HV + i_hv).to(tl.float32)
            b_S = b_S * tl.exp(b_g)
            b_d = b_beta * (b_vv - tl.sum(b_S * b_k[:, None], 0))
            b_S = b_S + b_k[:, None] * b_d[None, :]
            b_o = tl.sum(b_S * b_q[:, None], 0)
            b_G += b_g
            tl.store(o + (i_t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
            tl.store(delta + (i_t * HV + i_hv) * V + o_v, b_d, mask=m_v)
            if i_v == 0:
                tl.store(G + i_t * HV + i_hv + tl.zeros([1], dtype=tl.int64), b_G)
            slot = tl.load(slot_of + i_b * T + node)
            if slot >= 0:  # a branch point: later waves start from this state
                tl.store(branch + (slot * HV + i_hv) * K * V + tile, b_S, mask=m_s)


def hybrid_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, parents: Tensor, scale: float,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None, plan: HybridPlan | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Hybrid chain-decomposed verify (docs/DESIGN.md section 4, kernel 3).

    Each tree is split into heavy-light chains; chains run serially with their state tile
    resident, chains of one wave in parallel (one launch per wave; O(log N) waves); only the
    states at branch points with light children are materialised. The root chain of every
    sequence applies the pending commit (fused) before anything else reads the state.

    Args:
        q, k, v, g, beta, state, scale, pending, out: as :func:`serial_verify`.
        parents: ``[B, T]`` int64 topologically ordered parents (``-1`` = child of the state),
            e.g. ``DraftTree.parents_with_root``.
        plan: :func:`hybrid_plan` of ``parents``, when the caller reuses it across layers.
    Returns:
        ``o``, ``delta``, ``G`` as :func:`tree_verify`.
    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    B, T, H, K = k.shape
    _check(q, k, v, g, beta, state, pending)
    if parents.shape != (B, T) or parents.dtype != torch.int64:
        raise ValueError(f"parents must be int64 [{B}, {T}], got {parents.dtype} {list(parents.shape)}")
    HV, V = v.shape[2], v.shape[3]
    dev = v.device
    plan = plan if plan is not None else hybrid_plan(parents)
    if pending is not None and plan.waves[0][0].shape[0] != B:  # host-side: no sync, graph-capturable
        # several chains would read (and commit) the same state: the fused commit needs one root
        raise ValueError("hybrid_verify with a pending commit needs root-explicit trees (one node with parent -1)")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if out is None:
        out = (torch.empty_like(v), torch.empty(B, T, HV, V, dtype=torch.float32, device=dev),
               torch.empty(B, T, HV, dtype=torch.float32, device=dev))
    o, d, G = out
    branch = torch.empty(max(plan.num_slots, 1), HV, K, V, dtype=torch.float32, device=dev)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), TUNING["chain"]["BV"])
    for w, (seq, nodes, lens, par, src) in enumerate(plan.waves):
        _chain_kernel[(seq.shape[0] * HV, triton.cdiv(V, BV))](
            q, k, v, g, beta, state, o, d, G, branch, seq, nodes, lens, par, src, plan.slot_of,
            scale=scale, T=T, L=nodes.shape[1], H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
            **_pending_kwargs(pending if w == 0 else None),  # only the root chains commit
            num_warps=TUNING["chain"]["num_warps"],
        )
    return out


@dataclass
class HybridPlan:
    """Launch plan of :func:`hybrid_verify` for one batch of trees (every layer of a verify pass
    shares it, so it is built once per step on the host).

    Attributes:
        waves: per wave, ``(seq [C], nodes [C, L], lengths [C], parent [C], src [C])`` int64 on the
            device: each chain's sequence, node ids (``-1`` padded), length, the node it hangs from
            (``-1``: the committed state) and the branch slot holding that node's state.
        slot_of: ``[B, T]`` int64 branch slot of each node whose state a later chain reads, else -1.
        num_slots: number of materialised branch-point states per head.
    """

    waves: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]
    slot_of: Tensor
    num_slots: int


def hybrid_plan(parents: Tensor) -> HybridPlan:
    """Heavy-light chains of every tree of ``parents`` (``[B, T]`` int64), grouped into waves of
    chains whose start state is ready (``specla.tree.heavy_light_chains``). Host work, linear in
    the batch: each distinct tree shape is decomposed once (rows of a batch often share one)."""
    B, T = parents.shape
    waves: dict[int, list] = {}
    slot_of = [[-1] * T for _ in range(B)]
    n_slots = 0
    for b, par in enumerate(parents.tolist()):
        chains = _chains_of(tuple(par))
        for c in chains:
            if c.parent >= 0 and slot_of[b][c.parent] < 0:
                slot_of[b][c.parent] = n_slots
                n_slots += 1
        for c in chains:
            waves.setdefault(c.wave, []).append((b, c.nodes, c.parent, slot_of[b][c.parent] if c.parent >= 0 else -1))
    planned = []
    for w in sorted(waves):
        chains = waves[w]
        L = max(len(nodes) for _, nodes, _, _ in chains)
        cols = [[c[0] for c in chains], [len(c[1]) for c in chains], [c[2] for c in chains], [c[3] for c in chains]]
        nodes = [list(c[1]) + [-1] * (L - len(c[1])) for c in chains]
        seq, lens, par, src = torch.tensor(cols, dtype=torch.int64).to(parents.device, non_blocking=True)
        planned.append((seq, torch.tensor(nodes, dtype=torch.int64).to(parents.device, non_blocking=True), lens, par, src))
    return HybridPlan(planned, torch.tensor(slot_of, dtype=torch.int64).to(parents.device), n_slots)


@functools.lru_cache(maxsize=4096)
def _chains_of(parents: tuple[int, ...]):
    from specla.tree import heavy_light_chains

    return heavy_light_chains(list(parents))


def is_chain_batch(parents: Tensor, counts: Tensor) -> bool:
    """Whether the first ``counts[b]`` nodes of every row form a chain (node ``i`` is the child of
    node ``i - 1``, node 0 hangs from the state); the rest of a row is padding. Such batches can
    use :func:`serial_verify` with ``num_nodes = counts``. Padding cannot be told from real root
    children by ``parents`` alone, hence ``counts``."""
    idx = torch.arange(parents.shape[1], device=parents.device)
    real = idx[None, :] < counts[:, None]
    return bool(((parents == idx - 1) | (idx == 0) | ~real).all())


def pick_verify_kernel(parents: Tensor, counts: Tensor, choice: str = "auto") -> str:
    """``serial`` / ``parallel`` / ``hybrid`` for a batch of trees (``counts``: real nodes per row).

    ``auto``: the tree-masked parallel kernel wherever it was the fastest at the GDN-1.3B layer
    shape (every chain and tree of up to 32 nodes, and 64-node trees at batch 8 and 64; figures
    in docs/tuning.md, "GDN verify kernel choice"); hybrid won only at 64 nodes and batch 1. So:
    more than 32 nodes at batch 1 -> hybrid; up to ``MAX_TREE_NODES`` -> parallel; larger chains
    -> serial, larger trees -> hybrid. A forced ``serial`` on trees that are not chains, or
    ``parallel`` beyond ``MAX_TREE_NODES``, falls back to ``hybrid``.
    """
    B, T = parents.shape
    is_chain = is_chain_batch(parents, counts)
    if choice == "auto":
        if T > MAX_TREE_NODES:
            return "serial" if is_chain else "hybrid"
        return "hybrid" if (T > 32 and B == 1) else "parallel"
    if (choice == "serial" and not is_chain) or (choice == "parallel" and T > MAX_TREE_NODES):
        return "hybrid"
    return choice
