"""Triton verify kernels for GLA (docs/DESIGN.md sections 4 (kernel plan) and 5).

``serial_verify``: the state-resident serial verify for chains. ``tree_verify``: the tree-masked
parallel verify for trees of up to 64 nodes. Both start with the fused delayed commit: one program
per (sequence, head, V tile) loads its ``[K, BV]`` state tile once, applies the pending accepted
path of the previous step in closed form from its factor records
(``S = diag(exp(Gk_a)) S + sum_j diag(exp(Gk_a - Gk_j)) k_j v_j^T``), writes the committed state
once, then verifies from the same tile. GLA has no delta correction, so this step's factor record
is the inputs ``k``, ``v`` plus the path-summed log decay ``Gk`` the kernels emit. The state is
never written with speculative tokens.

Runs on GPU, and on CPU under ``TRITON_INTERPRET=1`` (how CI tests it against ``naive.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specla.ops.act_triton import softplus
from specla.ops.pending import check_layer_commit, pending_launch, with_pending
from specla.ops.tree_triton import PLACEMENT, ancestor_mask_tile, token_rows
from specla.records import LayerCommit

from .records import GLAFactorRecord

PENDING_FIELDS = dict(pk="k", pv="v", pGk="Gk")  # kernel parameter -> GLAFactorRecord field
MAX_TREE_NODES = 64  # register tiles of [BT, BK]; larger trees use the reference path


@triton.jit
def _apply_pending(b_S, p_S, m_s, pk, pv, pGk, path, path_len, i_b, i_r, off, i_h, o_k, o_v, m_k, m_v,
                   P, Tp, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Fused delayed commit of one state tile, written back once; an empty path leaves the tile
    (and memory) untouched. Sequence ``i_b``'s path entries less ``off`` are node indices into
    its records' row ``i_r`` (specla's own calls: ``i_r = i_b``, ``off = 0``)."""
    n_p = tl.load(path_len + i_b)
    if n_p > 0:
        end = tl.load(path + i_b * P + n_p - 1) - off
        G_a = tl.load(pGk + ((i_r * Tp + end) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        acc = b_S * tl.exp(G_a)[:, None]
        for j in range(0, P):
            if j < n_p:
                node = tl.load(path + i_b * P + j) - off
                row = (i_r * Tp + node) * H + i_h
                G_j = tl.load(pGk + row * K + o_k, mask=m_k, other=0.0)
                b_kp = tl.load(pk + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * tl.exp(G_a - G_j)
                b_vp = tl.load(pv + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                acc += b_kp[:, None] * b_vp[None, :]
        b_S = acc
        tl.store(p_S, b_S, mask=m_s)
    return b_S


@with_pending
@triton.jit
def _serial_verify_kernel(
    q, k, v, gk, S, o, Gk, num_nodes,
    pk, pv, pGk, path, path_len,
    scale, T, P, Tp,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr,
):
    i_v, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_S = S + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    if HAS_PENDING:  # fused delayed commit: the committed state is written once
        b_S = _apply_pending(b_S, p_S, m_s, pk, pv, pGk, path, path_len, i_b, i_b, 0, i_h, o_k, o_v, m_k,
                             m_v, P, Tp, H, K, V)
    n = tl.load(num_nodes + i_b)
    b_G = tl.zeros([BK], dtype=tl.float32)
    for t in range(0, T):
        row = (i_b * T + t) * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_vv = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(gk + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        valid = t < n
        S_new = b_S * tl.exp(b_g)[:, None] + b_k[:, None] * b_vv[None, :]
        b_o = tl.sum(S_new * b_q[:, None], 0)
        b_S = tl.where(valid, S_new, b_S)
        b_G = tl.where(valid, b_G + b_g, b_G)
        tl.store(o + row * V + o_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
        if i_v == 0:
            tl.store(Gk + row * K + o_k, tl.where(valid, b_G, 0.0), mask=m_k)


def _check(q, k, v, gk, state, pending) -> None:
    """Shapes, dtypes and devices shared by the verify kernels (raises ValueError)."""
    B, T, H, K = k.shape
    if q.shape != k.shape or v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    V = v.shape[3]
    for name, x, shape in (("gk", gk, (B, T, H, K)), ("state", state, (B, H, K, V))):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {list(x.shape)}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (the committed state is written in place)")
    if len({x.device for x in [q, k, v, gk, state, *(pending.tensors() if pending else [])]}) != 1:
        raise ValueError("all tensors must be on one device")
    if pending is not None:
        _check_pending(B, H, K, V, pending)


def _check_pending(B, H, K, V, pending: LayerCommit) -> None:
    """A pending commit's factor records and path must match the state's shape (ValueError)."""
    check_layer_commit(pending, GLAFactorRecord, B, dict(k=(H, K), v=(H, V), Gk=(H, K)), float32=("Gk",))


def _pending_kwargs(pending: LayerCommit | None) -> dict:
    """The launch's keyword arguments of an optional pending commit (:mod:`specla.ops.pending`)."""
    return pending_launch(pending, PENDING_FIELDS)


def _outputs(v, K, out):
    B, T, H, V = v.shape
    if out is None:
        out = (torch.empty_like(v), torch.empty(B, T, H, K, dtype=torch.float32, device=v.device))
    return out


def serial_verify(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, state: Tensor, num_nodes: Tensor, scale: float,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """State-resident serial verify of a batch of chains, with the fused delayed commit.

    Node ``t`` of sequence ``b`` is the child of node ``t - 1`` (node 0 hangs from the committed
    state); nodes ``t >= num_nodes[b]`` are padding and get zero outputs.

    Args:
        q, k: ``[B, T, H, K]`` queries/keys after the feature map (float32 or bfloat16).
        v: ``[B, T, H, V]`` (float32 or bfloat16).
        gk: ``[B, T, H, K]`` float32 per-channel log decay.
        state: ``[B, H, K, V]`` float32 committed state; the pending commit, if any, is applied
            to it **in place** (and nothing else is written to it).
        num_nodes: ``[B]`` int64 chain length per sequence (``0..T``).
        scale: query scale (``K ** -0.5``).
        pending: the previous step's commit, :class:`specla.records.LayerCommit` of a
            ``GLAFactorRecord`` (``k [B, Tp, H, K]``, ``v [B, Tp, H, V]``, ``Gk [B, Tp, H, K]``
            float32), ``path [B, P]`` and ``path_len [B]`` int64; ``path_len[b] = 0`` leaves
            sequence ``b``'s state bit-identical.
        out: optional preallocated ``(o, Gk)`` (tests pass NaN-filled tensors).
    Returns:
        ``o [B, T, H, V]`` (``v.dtype``) and ``Gk [B, T, H, K]`` float32 (path-summed log decay;
        with ``k`` and ``v`` the factor record ``gla.records.GLAFactorRecord``).
    Raises:
        ValueError: shapes, dtypes or devices disagree (checked before any launch).
    Formula: docs/DESIGN.md section 5 (serial recurrence; closed-form commit).
    """
    B, T, H, K = k.shape
    _check(q, k, v, gk, state, pending)
    if num_nodes.shape != (B,) or num_nodes.dtype != torch.int64 or num_nodes.device != k.device:
        raise ValueError(f"num_nodes must be int64 [{B}] on {k.device}, got {num_nodes.dtype} {list(num_nodes.shape)}")
    V = v.shape[3]
    q, k, v, gk = (x.contiguous() for x in (q, k, v, gk))
    o, G = out = _outputs(v, K, out)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)
    _serial_verify_kernel[(B * H, triton.cdiv(V, BV))](
        q, k, v, gk, state, o, G, num_nodes, scale=scale, T=T, H=H, K=K, V=V, BK=BK, BV=BV,
        **_pending_kwargs(pending),
    )
    return out


@triton.heuristics({"RAW_GATES": lambda args: args["A_log"] is not None, **PLACEMENT})
@triton.jit
def _tree_decay_kernel(gk, mask, Gk, cu_seqlens, parents, rec_idx, A_log, dt_bias, T, SG, D, sP,
                       H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       VARLEN: tl.constexpr, RAW_GATES: tl.constexpr, ANC: tl.constexpr):
    """Per (sequence, head): Gk = M_incl @ gk, the path-summed log decay (not a node-order cumsum).

    Where the data lives (specla's own calls use the first of each): tokens of sequence ``b`` at
    rows ``b * T + t`` or packed at ``cu_seqlens[b] + t`` (``VARLEN``), ``SG`` elements apart;
    the ancestors from ``mask [B, T, T]``, one parent index per node or a chain
    (:func:`specla.ops.tree_triton.ancestor_mask_tile`); node ``t``'s ``Gk`` at row ``r * D + t``,
    ``r = b`` or ``rec_idx[b]`` (a negative row writes none); ``gk`` given, or the raw gate
    input in its place (``RAW_GATES``: ``gk = -exp(A_log[h]) softplus(a + dt_bias[h, c])``,
    KDA's per-channel gate, in float32)."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    bos, n = token_rows(cu_seqlens, i_b, T, VARLEN)
    row = i_b
    if rec_idx is not None:
        row = tl.load(rec_idx + i_b).to(tl.int64)
    m_t, m_k = o_t < n, o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_M = ancestor_mask_tile(mask, parents, i_b, T, sP, o_t, m_t, ANC)
    b_g = tl.load(gk + (bos + o_t[:, None]) * SG + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if RAW_GATES:
        x = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        b_g = tl.where(m_tk, -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * softplus(x), 0.0)
    b_G = tl.dot(b_M.to(tl.float32), b_g, input_precision="ieee")
    m_rec = m_tk & (row >= tl.zeros([BT, BK], dtype=tl.int64))
    tl.store(Gk + ((row * D + o_t[:, None]) * H + i_h) * K + o_k[None, :], b_G, mask=m_rec)


def launch_decay(B: int, gk: Tensor, Gk: Tensor, T: int, H: int, K: int, BT: int, BK: int, **where) -> None:
    """:func:`_tree_decay_kernel` over ``B`` sequences of at most ``T`` nodes; ``where`` gives its
    data-placement arguments (``mask``/``parents``, ``cu_seqlens``, ``rec_idx``, ``A_log``/
    ``dt_bias``, ``SG``, ``D``, ``sP``), those left out being specla's own ``[B, T, H, K]``."""
    where = dict(mask=None, cu_seqlens=None, parents=None, rec_idx=None, A_log=None, dt_bias=None, SG=H * K, D=T,
                 sP=0) | where
    _tree_decay_kernel[(B * H,)](gk=gk, Gk=Gk, T=T, H=H, K=K, BT=BT, BK=BK, **where)


@with_pending
@triton.jit
def _tree_verify_kernel(
    q, k, v, mask, Gk, S, o,
    pk, pv, pGk, path, path_len,
    scale, T, P, Tp,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr,
):
    """Per (sequence, head, V tile): fused delayed commit, then every node at once:
    O = (scale q * exp(Gk)) S0 + sum_j A[:, j] v_j^T with
    A[i, j] = sum_c scale q_i[c] k_j[c] exp(Gk_i[c] - Gk_j[c]) on ancestor pairs (j on path(i))."""
    i_v, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t, m_k, m_v = o_t < T, o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_S = S + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    if HAS_PENDING:
        b_S = _apply_pending(b_S, p_S, m_s, pk, pv, pGk, path, path_len, i_b, i_b, 0, i_h, o_k, o_v, m_k,
                             m_v, P, Tp, H, K, V)
    m_tk = m_t[:, None] & m_k[None, :]
    rows = (i_b * T + o_t[:, None]) * H + i_h
    b_q = tl.load(q + rows * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
    b_G = tl.load(Gk + rows * K + o_k[None, :], mask=m_tk, other=0.0)
    b_o = tl.dot(b_q * tl.exp(b_G), b_S, input_precision="ieee")  # exp(Gk) <= 1: no overflow
    for j in range(0, T):
        row = (i_b * T + j) * H + i_h
        b_kj = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_Gj = tl.load(Gk + row * K + o_k, mask=m_k, other=0.0)
        b_vj = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        on = tl.load(mask + i_b * T * T + o_t * T + j, mask=m_t, other=0) != 0  # is j on path(i)?
        # mask the exponent before exp: off-path pairs would be exp(positive)
        w = tl.where(on[:, None], tl.exp(tl.where(on[:, None], b_G - b_Gj[None, :], 0.0)), 0.0)
        a_j = tl.sum(b_q * b_kj[None, :] * w, 1)  # [BT]
        b_o += a_j[:, None] * b_vj[None, :]
    tl.store(o + ((i_b * T + o_t[:, None]) * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


def tree_verify(
    q: Tensor, k: Tensor, v: Tensor, gk: Tensor, state: Tensor, mask: Tensor, scale: float,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Tree-masked parallel verify of a batch of trees, with the fused delayed commit.

    Args:
        q, k, v, gk, state, scale, pending, out: as :func:`serial_verify`.
        mask: ``[B, T, T]`` bool inclusive-ancestor mask (``specla.tree.inclusive_ancestor_mask``),
            ``T <= 64``.
    Returns:
        ``o [B, T, H, V]`` (``v.dtype``) and ``Gk [B, T, H, K]`` float32, every node as if its
        root path had been decoded serially from the committed state.
    Raises:
        ValueError: shapes, dtypes, devices disagree, or ``T > 64``.
    Formula: docs/DESIGN.md section 5 (tree form: path-summed decay per channel). ``Gk`` is
    computed once per (sequence, head) by a first kernel and shared by all V tiles.
    """
    B, T, H, K = k.shape
    _check(q, k, v, gk, state, pending)
    if mask.shape != (B, T, T) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{B}, {T}, {T}], got {mask.dtype} {list(mask.shape)}")
    if T > MAX_TREE_NODES:
        raise ValueError(f"tree_verify handles at most {MAX_TREE_NODES} nodes, got {T}")
    V = v.shape[3]
    q, k, v, gk = (x.contiguous() for x in (q, k, v, gk))
    mask = mask.contiguous()  # bool: the kernels load it as int1 (no int8 copy per layer)
    BT = max(16, triton.next_power_of_2(T))
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(triton.next_power_of_2(V), 64))
    o, G = out = _outputs(v, K, out)
    launch_decay(B, gk, G, T, H, K, BT, BK, mask=mask)
    _tree_verify_kernel[(B * H, triton.cdiv(V, BV))](
        q, k, v, mask, G, state, o, scale=scale, T=T, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        **_pending_kwargs(pending),
    )
    return out


def is_chain_batch(parents: Tensor, counts: Tensor) -> bool:
    """Whether the first ``counts[b]`` nodes of every row form a chain (node ``i`` is the child of
    node ``i - 1``, node 0 hangs from the state); the rest of a row is padding."""
    idx = torch.arange(parents.shape[1], device=parents.device)
    real = idx[None, :] < counts[:, None]
    return bool(((parents == idx - 1) | (idx == 0) | ~real).all())


def pick_verify_kernel(parents: Tensor, counts: Tensor, choice: str = "auto") -> str:
    """``serial`` / ``parallel`` / ``reference`` for a batch of trees (``counts``: real nodes per row).

    ``auto``: chains of up to 32 nodes -> parallel (at the GLA-1.3B layer shape as fast as serial
    at batch 1 and faster at larger batches; docs/tuning.md, "GLA verify kernel choice"), longer
    chains -> serial; trees up to ``MAX_TREE_NODES`` nodes -> parallel,
    larger -> reference (PyTorch). GLA has no hybrid kernel yet: ``hybrid`` is treated as
    ``auto``; a forced ``serial`` on trees that are not chains takes the parallel kernel.
    """
    T = parents.shape[1]
    chain = is_chain_batch(parents, counts)
    if choice == "serial" and chain:
        return "serial"
    if choice == "parallel" or not chain or T <= 32:
        return "parallel" if T <= MAX_TREE_NODES else "reference"
    return "serial"
