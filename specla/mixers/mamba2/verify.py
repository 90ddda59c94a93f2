"""Triton verify kernels for Mamba2 / SSD (docs/DESIGN.md sections 4-5, kernel plan).

``serial_verify``: the state-resident serial verify for chains. One program per (sequence, head,
``P`` tile) loads its ``[N, BP]`` state tile once, applies the pending accepted path of the
previous step in closed form from its factor records (the fused delayed commit), writes the
committed state once, then runs the chain's tokens with the tile held in registers, emitting
outputs and this step's factor records (``u = dt * x`` and the path-summed log decay ``G``).
``tree_verify``: the tree-masked factorized (parallel) verify for trees of up to 64 nodes, with
the same fused commit. The state is never written with speculative tokens.

Runs on GPU, and on CPU under ``TRITON_INTERPRET=1`` (how CI tests it against ``naive.py``).
Shapes as ``reference.py``: ``B`` sequences, ``T`` nodes, ``H`` heads, ``P`` head dim, ``NG``
groups of ``Bm``/``Cm`` (head ``h`` reads group ``h // (H // NG)``), ``N`` state size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specla.ops.act_triton import softplus
from specla.ops.pending import check_layer_commit, own_slots, pending_launch, with_pending
from specla.ops.tree_triton import (
    CHAIN_PLACEMENT, PLACEMENT, ancestor_mask_tile, chain_rows, chain_step, token_rows,
)
from specla.records import LayerCommit

from .records import Mamba2FactorRecord

PENDING_FIELDS = dict(pB="Bm", pu="u", pG="G")  # kernel parameter -> Mamba2FactorRecord field
# the serial kernel's state-stride and layer-stride parameters (specla.ops.pending.own_slots)
SLOT_PARAMS = dict(strides=("sS_b", "sS_h", "sS_n", "sS_p"), layers=("lS", "lB", "lu", "lG"))

MAX_TREE_NODES = 64  # register tiles of [BT, BT]; larger trees run the reference path

# The verify kernels' launches: "BP", the widest P tile a program holds (with the whole [N, BP]
# state tile: a narrower one holds fewer registers and gives small batches more programs), and
# their warps. The tree kernel narrows its tile (to 16 at least, tl.dot's) while a launch would
# have fewer than "programs" programs: a small batch then fills the GPU's SMs. It holds a state
# size up to "BN" whole and visits a larger one in blocks of "BN_split" rows (a state size of 256
# held whole, or in blocks of 128, compiled to heavy register spills and ran small trees far
# slower; blocks of 32 slower from batch 8; docs/tuning.md). "dot":
# the tree kernel's products' precision where the activations are not float32 (float32 runs take "ieee"),
# as the GDN tree kernel's (specla.mixers.gdn.verify.TUNING): "tf32x3" keeps float32's accuracy on
# the tensor cores, "ieee" keeps the products off them (docs/tuning.md, "Mamba2 verify launch
# parameters"). "num_stages": the software pipelining of the tree kernel's loop over N blocks
# (Triton's default, 3). benchmarks/engine_kernels.py --mamba2-tree, --mamba2-serial (BP,WARPS),
# --mamba2-split, --mamba2-stages and --mamba2-dot time other settings.
TUNING = {"tree": {"BP": 64, "BN": 128, "BN_split": 64, "programs": 128, "num_warps": 4, "num_stages": 3,
                   "dot": "tf32x3"},
          "serial": {"BP": 16, "num_warps": 1}}


@triton.jit
def _apply_pending(b_S, p_S, m_s, pB, pu, pG, path, path_len, i_b, i_r, off, i_g, i_h, o_n, o_p, m_n, m_p,
                   Lp, Tp, H: tl.constexpr, NG: tl.constexpr, N: tl.constexpr, P: tl.constexpr):
    """Fused delayed commit of one state tile: S = exp(G_a) S + sum_{j on path} exp(G_a - G_j)
    Bm_j u_j^T, written back once (where ``m_s``); an empty path leaves the tile (and memory)
    untouched. Sequence ``i_b``'s path entries less ``off`` are node indices into its records'
    row ``i_r``."""
    n_p = tl.load(path_len + i_b)
    if n_p > 0:
        end = tl.load(path + i_b * Lp + n_p - 1) - off
        G_a = tl.load(pG + (i_r * Tp + end) * H + i_h)
        acc = b_S * tl.exp(G_a)
        for j in range(0, Lp):
            if j < n_p:
                node = tl.load(path + i_b * Lp + j) - off
                w = tl.exp(G_a - tl.load(pG + (i_r * Tp + node) * H + i_h))
                b_bp = tl.load(pB + ((i_r * Tp + node) * NG + i_g) * N + o_n, mask=m_n, other=0.0)
                b_up = tl.load(pu + ((i_r * Tp + node) * H + i_h) * P + o_p, mask=m_p, other=0.0)
                acc += w * b_bp.to(tl.float32)[:, None] * b_up.to(tl.float32)[None, :]
        b_S = acc
        tl.store(p_S, b_S, mask=m_s)
    return b_S


@triton.jit
def _load_D(D, i_h, o_p, m_p, P: tl.constexpr, BP: tl.constexpr, D_HDIM: tl.constexpr):
    """The skip weights of head ``i_h`` for a ``P`` tile: ``D[h, p]`` or the scalar ``D[h]``."""
    if D_HDIM:
        b_D = tl.load(D + i_h * P + o_p, mask=m_p, other=0.0)
    else:
        b_D = tl.load(D + i_h + tl.zeros([BP], dtype=tl.int64))
    return b_D.to(tl.float32)


@triton.jit
def _slot_rows(state_idx, rec_idx, i_b, SLOTS: tl.constexpr):
    """Sequence ``i_b``'s state slot and record row: ``i_b`` and ``i_b``, or ``state_idx[i_b]``
    and ``rec_idx[i_b]`` (``SLOTS``; a negative slot is neither read nor written, a negative row
    has no records)."""
    if SLOTS:
        return tl.load(state_idx + i_b).to(tl.int64), tl.load(rec_idx + i_b).to(tl.int64)
    else:
        return i_b, i_b


@triton.jit
def _state_tile(S, slot, i_h, o_n, o_p, m_n, m_p, sS_b, sS_h, sS_n, sS_p, BP: tl.constexpr):
    """The pointers and mask of a state tile in ``slot`` (:func:`_slot_rows`): element ``(h, n,
    p)`` at ``h sS_h + n sS_n + p sS_p``."""
    m_s = m_n[:, None] & m_p[None, :] & (slot >= tl.zeros([1, BP], dtype=tl.int64))
    p_S = S + slot * sS_b + i_h * sS_h + o_n[:, None] * sS_n + o_p[None, :] * sS_p
    return p_S, m_s


@with_pending
@triton.heuristics({"SLOTS": lambda args: args["state_idx"] is not None,
                    "RAW_DT": lambda args: args["A"] is not None,
                    **CHAIN_PLACEMENT})
@triton.jit
def _serial_verify_kernel(
    x, dt, a, Bm, Cm, D, S, y, u, G, num_nodes,
    pB, pu, pG, path, path_len, state_idx, rec_idx, cu_seqlens, A, dt_bias, rB,
    T, Lp, Tp, SX, SDT, SBC, SY, RD, sS_b, sS_h, sS_n, sS_p, path_step, lS, lB, lu, lG,
    H: tl.constexpr, NG: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, HAS_PENDING: tl.constexpr, D_HDIM: tl.constexpr, SLOTS: tl.constexpr,
    RAW_DT: tl.constexpr, VARLEN: tl.constexpr, OWN: tl.constexpr,
):
    """Per (sequence, head, P tile[, layer]): the pending commit, then the chain's tokens.

    Where the data lies (specla's own calls use the first of each): ``num_nodes[b]`` tokens of
    sequence ``b`` at rows ``b * T + t`` (``OWN``: the nodes past them are padding and get zero
    outputs and records), or every row ``T`` tokens, or packed at ``cu_seqlens[b] + t``
    (``VARLEN``; rows past a sequence's tokens are not written); rows ``SX`` (x), ``SDT`` (dt,
    a), ``SBC`` (Bm, Cm) and ``SY`` (y) elements apart, each row dense; the state and records
    as :func:`_slot_rows` and :func:`_state_tile` place them, the records ``u``, ``G`` (and
    ``Bm`` in float32 into ``rB``, when given) of node ``t`` at row ``r * RD + t`` (a negative
    row writes none); step sizes ``dt`` and log decays ``a`` given, or from the raw ``dt``
    (``RAW_DT``: ``dt = softplus(dt + dt_bias)``, ``a = dt A``, in float32). The pending records
    are those of node ``path[b, j] - b * path_step``. A third grid axis runs one commit per
    layer (``T = 0``): layer ``l``'s state and records lie ``l lS``, ``l lB``, ``l lu``, ``l lG``
    elements on."""
    i_p, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    S += i_l * lS
    if HAS_PENDING:
        pB += i_l * lB
        pu += i_l * lu
        pG += i_l * lG
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // NG)
    o_n = tl.arange(0, BN)
    o_p = i_p * BP + tl.arange(0, BP)
    m_n, m_p = o_n < N, o_p < P
    slot, i_r = _slot_rows(state_idx, rec_idx, i_b, SLOTS)
    p_S, m_s = _state_tile(S, slot, i_h, o_n, o_p, m_n, m_p, sS_b, sS_h, sS_n, sS_p, BP)
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    if HAS_PENDING:  # fused delayed commit: the committed state is written once
        b_S = _apply_pending(b_S, p_S, m_s, pB, pu, pG, path, path_len, i_b, i_r, i_b * path_step, i_g, i_h,
                             o_n, o_p, m_n, m_p, Lp, Tp, H, NG, N, P)
    b_D = _load_D(D, i_h, o_p, m_p, P, BP, D_HDIM)
    bos, n = chain_rows(cu_seqlens, num_nodes, i_b, T, VARLEN, OWN)
    if RAW_DT:
        zero = tl.zeros([1], dtype=tl.int64)
        b_bias = tl.load(dt_bias + i_h + zero).to(tl.float32)
        b_A = tl.load(A + i_h + zero).to(tl.float32)
    has_row = (tl.zeros([1], dtype=tl.int64) + i_r) >= 0  # [1], as the masks it joins
    b_G = tl.zeros([1], dtype=tl.float32)
    for t in range(0, T):
        tok = bos + t
        valid, write = chain_step(t, n, OWN)
        one = tok * SDT + i_h + tl.zeros([1], dtype=tl.int64)
        b_x = tl.load(x + tok * SX + i_h * P + o_p, mask=m_p & valid, other=0.0).to(tl.float32)
        if RAW_DT:
            b_dt = softplus(tl.load(dt + one, mask=valid, other=0.0).to(tl.float32) + b_bias)
            b_a = b_dt * b_A
        else:
            b_dt = tl.load(dt + one, mask=valid, other=0.0).to(tl.float32)
            b_a = tl.load(a + one, mask=valid, other=0.0).to(tl.float32)
        b_b = tl.load(Bm + tok * SBC + i_g * N + o_n, mask=m_n & valid, other=0.0).to(tl.float32)
        b_c = tl.load(Cm + tok * SBC + i_g * N + o_n, mask=m_n & valid, other=0.0).to(tl.float32)
        b_u = b_dt * b_x
        S_new = b_S * tl.exp(b_a)[:, None] + b_b[:, None] * b_u[None, :]
        b_y = tl.sum(S_new * b_c[:, None], 0) + b_D * b_x
        G_new = b_G + b_a
        b_S = tl.where(valid, S_new, b_S)
        b_G = tl.where(valid, G_new, b_G)
        rec = i_r * RD + t
        tl.store(y + tok * SY + i_h * P + o_p, tl.where(valid, b_y, 0.0).to(y.dtype.element_ty), mask=m_p & write)
        tl.store(u + (rec * H + i_h) * P + o_p, tl.where(valid, b_u, 0.0), mask=m_p & write & has_row)
        if i_p == 0:
            tl.store(G + rec * H + i_h + tl.zeros([1], dtype=tl.int64), tl.where(valid, G_new, 0.0),
                     mask=write & has_row)
            if rB is not None:  # the records' Bm in float32, from one program per group
                if i_h % (H // NG) == 0:
                    tl.store(rB + (rec * NG + i_g) * N + o_n, b_b, mask=m_n & write & has_row)


@with_pending
@triton.heuristics({"SLOTS": lambda args: args["state_idx"] is not None,
                    "RAW_DT": lambda args: args["A"] is not None, **PLACEMENT})
@triton.jit
def _tree_verify_kernel(
    x, dt, a, Bm, Cm, D, mask, S, y, u, G,
    pB, pu, pG, path, path_len,
    cu_seqlens, parents, state_idx, rec_idx, A, dt_bias, rB,
    T, Lp, Tp, SX, SDT, SBC, SY, RD, sP, sS_b, sS_h, sS_n, sS_p,
    H: tl.constexpr, NG: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, HAS_PENDING: tl.constexpr, D_HDIM: tl.constexpr,
    VARLEN: tl.constexpr, SLOTS: tl.constexpr, RAW_DT: tl.constexpr, ANC: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Per (sequence, head, P tile): fused delayed commit, then the tree-masked factorized SSD:
    y = exp(G) Cm S0 + ((Cm Bm^T) * Gam) u + D x with G = M_incl a and u = dt x.

    Where the data lies (specla's own calls use the first of each): tokens of sequence ``b`` at
    rows ``b * T + t`` or packed at ``cu_seqlens[b] + t`` (``VARLEN``; ``n <= BT`` tokens), rows
    ``SX`` (x), ``SDT`` (dt, a), ``SBC`` (Bm, Cm) and ``SY`` (y) elements apart, each row dense;
    the tree as the ancestor mask or one parent per node (:func:`ancestor_mask_tile`); the state
    and records as :func:`_slot_rows` and :func:`_state_tile` place them, the records ``u``,
    ``G`` (and ``Bm`` in float32 into ``rB``, when given) of node ``t`` at row ``r * RD + t`` (a
    negative row writes none); step sizes ``dt`` and log decays ``a`` given, or from the raw
    ``dt`` (``RAW_DT``: ``dt = softplus(dt + dt_bias)``, ``a = dt A``, in float32)."""
    i_p, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // NG)
    o_t = tl.arange(0, BT)
    o_p = i_p * BP + tl.arange(0, BP)
    bos, n = token_rows(cu_seqlens, i_b, T, VARLEN)
    m_t, m_p = o_t < n, o_p < P
    b_D = _load_D(D, i_h, o_p, m_p, P, BP, D_HDIM)
    b_M = ancestor_mask_tile(mask, parents, i_b, T, sP, o_t, m_t, ANC)
    tok = bos + o_t
    b_dt = tl.load(dt + tok * SDT + i_h, mask=m_t, other=0.0).to(tl.float32)
    if RAW_DT:
        b_dt = tl.where(m_t, softplus(b_dt + tl.load(dt_bias + i_h).to(tl.float32)), 0.0)
        b_a = b_dt * tl.load(A + i_h).to(tl.float32)
    else:
        b_a = tl.load(a + tok * SDT + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_G = tl.sum(tl.where(b_M, b_a[None, :], 0.0), 1)  # path-summed log decay, not a cumsum
    m_tp = m_t[:, None] & m_p[None, :]
    b_x = tl.load(x + tok[:, None] * SX + i_h * P + o_p[None, :], mask=m_tp, other=0.0).to(tl.float32)
    b_u = b_dt[:, None] * b_x
    # Cm S0 and Cm Bm^T over the state size in blocks of BN rows: a state, Bm and Cm tile of a
    # large N held whole would spill registers
    slot, row = _slot_rows(state_idx, rec_idx, i_b, SLOTS)
    rec = row * RD + o_t
    m_rec = m_t & (row >= tl.zeros([BT], dtype=tl.int64))  # a scalar mask would not broadcast
    b_CS = tl.zeros([BT, BP], dtype=tl.float32)
    b_CB = tl.zeros([BT, BT], dtype=tl.float32)
    for i_n in range(0, tl.cdiv(N, BN)):
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < N
        p_S, m_s = _state_tile(S, slot, i_h, o_n, o_p, m_n, m_p, sS_b, sS_h, sS_n, sS_p, BP)
        b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
        if HAS_PENDING:
            b_S = _apply_pending(b_S, p_S, m_s, pB, pu, pG, path, path_len, i_b, i_b, 0, i_g, i_h, o_n, o_p, m_n,
                                 m_p, Lp, Tp, H, NG, N, P)
        m_tn = m_t[:, None] & m_n[None, :]
        b_B = tl.load(Bm + tok[:, None] * SBC + i_g * N + o_n[None, :], mask=m_tn, other=0.0).to(tl.float32)
        b_C = tl.load(Cm + tok[:, None] * SBC + i_g * N + o_n[None, :], mask=m_tn, other=0.0).to(tl.float32)
        b_CB += tl.dot(b_C, tl.trans(b_B), input_precision=DOT_PREC)
        b_CS += tl.dot(b_C, b_S, input_precision=DOT_PREC)
        if rB is not None:  # the records' Bm in float32, from one program per group
            if (i_p == 0) & (i_h % (H // NG) == 0):
                tl.store(rB + (rec[:, None] * NG + i_g) * N + o_n[None, :], b_B, mask=m_rec[:, None] & m_n[None, :])
    # mask the exponent before exp: off-path pairs are exactly 0, exp(-G) never overflows
    gam = tl.where(b_M, tl.exp(tl.where(b_M, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
    b_y = tl.exp(b_G)[:, None] * b_CS + tl.dot(b_CB * gam, b_u, input_precision=DOT_PREC)
    b_y += b_D[None, :] * b_x
    tl.store(y + tok[:, None] * SY + i_h * P + o_p[None, :], b_y.to(y.dtype.element_ty), mask=m_tp)
    tl.store(u + (rec[:, None] * H + i_h) * P + o_p[None, :], b_u, mask=m_rec[:, None] & m_p[None, :])
    if i_p == 0:
        tl.store(G + rec * H + i_h, b_G, mask=m_rec)


def _check(x, dt, a, Bm, Cm, D, state, pending) -> None:
    """Shapes, dtypes and devices shared by the verify kernels (raises ValueError)."""
    if x.dim() != 4 or Bm.dim() != 4:
        raise ValueError(f"x must be [B, T, H, P] and Bm, Cm [B, T, NG, N]; got {list(x.shape)}, {list(Bm.shape)}")
    B, T, H, P = x.shape
    NG, N = Bm.shape[2], Bm.shape[3]
    if Bm.shape[:2] != (B, T) or Cm.shape != Bm.shape or H % NG:
        raise ValueError(f"Bm, Cm must be [{B}, {T}, NG, N] with H % NG == 0; got {list(Bm.shape)}, {list(Cm.shape)}")
    for name, t, shape in (("dt", dt, (B, T, H)), ("a", a, (B, T, H)), ("state", state, (B, H, N, P))):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    if tuple(D.shape) not in ((H,), (H, P)):
        raise ValueError(f"D must be [{H}] or [{H}, {P}], got {list(D.shape)}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (the committed state is written in place)")
    if len({t.device for t in [x, dt, a, Bm, Cm, D, state, *(pending.tensors() if pending else [])]}) != 1:
        raise ValueError("all tensors must be on one device")
    if pending is not None:
        _check_pending(B, H, NG, N, P, pending)


def _check_pending(B, H, NG, N, P, pending: LayerCommit) -> None:
    """A pending commit's factor records and path must match the state's shape (ValueError)."""
    check_layer_commit(pending, Mamba2FactorRecord, B, dict(Bm=(NG, N), u=(H, P), G=(H,)), float32=("u", "G"))


def _pending_kwargs(pending: LayerCommit | None) -> dict:
    """The launch's keyword arguments of an optional pending commit (:mod:`specla.ops.pending`;
    the path width is ``Lp``: ``P`` is the head dim here)."""
    return pending_launch(pending, PENDING_FIELDS, width="Lp")


def _outputs(x, out):
    B, T, H, P = x.shape
    if out is not None:
        return out
    f32 = dict(dtype=torch.float32, device=x.device)
    return torch.empty(B, T, H, P, **f32), torch.empty(B, T, H, P, **f32), torch.empty(B, T, H, **f32)


def serial_verify(
    x: Tensor, dt: Tensor, a: Tensor, Bm: Tensor, Cm: Tensor, D: Tensor, state: Tensor, num_nodes: Tensor,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """State-resident serial SSD verify of a batch of chains, with the fused delayed commit.

    Node ``t`` of sequence ``b`` is the child of node ``t - 1`` (node 0 hangs from the committed
    state); nodes ``t >= num_nodes[b]`` are padding and get zero outputs and records.

    Args:
        x: ``[B, T, H, P]`` SSM inputs (float32 or bfloat16).
        dt: ``[B, T, H]`` float32 step sizes; a: ``[B, T, H]`` float32 log decay ``dt * A``.
        Bm, Cm: ``[B, T, NG, N]`` (float32 or bfloat16); ``H % NG == 0``.
        D: ``[H]`` or ``[H, P]`` skip weights.
        state: ``[B, H, N, P]`` float32 committed state; the pending commit, if any, is applied
            to it **in place** (and nothing else is written to it).
        num_nodes: ``[B]`` int64 chain length per sequence (``0..T``).
        pending: the previous step's commit, :class:`specla.records.LayerCommit` of a
            ``Mamba2FactorRecord`` (``Bm [B, Tp, NG, N]``, ``u [B, Tp, H, P]`` float32, ``G [B,
            Tp, H]`` float32), ``path [B, L]`` and ``path_len [B]`` int64; ``path_len[b] = 0``
            leaves sequence ``b``'s state bit-identical.
        out: optional preallocated ``(y, u, G)`` (tests pass NaN-filled tensors).
    Returns:
        ``y [B, T, H, P]``, ``u [B, T, H, P]``, ``G [B, T, H]``, all float32: outputs and factor
        records (``mamba2.records.Mamba2FactorRecord``).
    Raises:
        ValueError: shapes, dtypes or devices disagree (checked before any launch).
    Formula: docs/DESIGN.md section 5 (serial SSD recurrence; closed-form commit).
    """
    _check(x, dt, a, Bm, Cm, D, state, pending)
    B, T = x.shape[:2]
    if num_nodes.shape != (B,) or num_nodes.dtype != torch.int64 or num_nodes.device != x.device:
        raise ValueError(f"num_nodes must be int64 [{B}] on {x.device}, got {num_nodes.dtype} {list(num_nodes.shape)}")
    out = _outputs(x, out)
    x, dt, a, Bm, Cm, D = (t.contiguous() for t in (x, dt, a, Bm, Cm, D))
    _launch_serial(B, T, x, dt, Bm, Cm, D, state, out, a=a, num_nodes=num_nodes, pending=pending,
                   **own_slots(state, **SLOT_PARAMS))
    return out


def tree_verify(
    x: Tensor, dt: Tensor, a: Tensor, Bm: Tensor, Cm: Tensor, D: Tensor, state: Tensor, mask: Tensor,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree-masked factorized (parallel) SSD verify of a batch of trees, with the fused delayed
    commit.

    Args:
        x, dt, a, Bm, Cm, D, state, pending, out: as :func:`serial_verify`.
        mask: ``[B, T, T]`` bool inclusive-ancestor mask (``specla.tree.inclusive_ancestor_mask``),
            ``T <= 64``.
    Returns:
        ``y``, ``u``, ``G`` as :func:`serial_verify`, every node as if its root path had been
        decoded serially from the committed state.
    Raises:
        ValueError: shapes, dtypes, devices disagree, or ``T > 64``.
    Formula: docs/DESIGN.md section 5 and ``reference.tree_ssd`` (SSD's quadratic form, Dao & Gu
    2024, with the tree's ancestor mask).
    """
    _check(x, dt, a, Bm, Cm, D, state, pending)
    B, T, H, P = x.shape
    NG, N = Bm.shape[2], Bm.shape[3]
    if mask.shape != (B, T, T) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{B}, {T}, {T}], got {mask.dtype} {list(mask.shape)}")
    if T > MAX_TREE_NODES:
        raise ValueError(f"tree_verify handles at most {MAX_TREE_NODES} nodes, got {T}")
    out = _outputs(x, out)
    x, dt, a, Bm, Cm, D = (t.contiguous() for t in (x, dt, a, Bm, Cm, D))
    _launch_tree(B, T, x, dt, Bm, Cm, D, state, out, a=a, mask=mask.contiguous(), pending=pending, T=T, SX=H * P,
                SDT=H, SBC=NG * N, SY=H * P, RD=T)
    return out


def _launch_tree(B: int, steps: int, x, dt, Bm, Cm, D, state, out, *, pending=None, state_strides=None,
                **where) -> None:
    """One launch of :func:`_tree_verify_kernel` over ``B`` sequences of at most ``steps`` nodes.
    ``out`` is ``(y, u, G)``; ``where`` gives the kernel's data-placement arguments (``a`` or
    ``A``/``dt_bias``, ``mask``/``parents``, ``cu_seqlens``, ``state_idx``, ``rec_idx``, ``rB``,
    the strides and sizes); those left out are specla's own layout; ``state_strides`` (slot,
    head, n, p) defaults to ``state``'s."""
    H, P = x.shape[-2], x.shape[-1]
    NG, N = Bm.shape[-2], Bm.shape[-1]
    y, u, G = out
    tune = TUNING["tree"]
    BP = max(16, min(triton.next_power_of_2(P), tune["BP"]))  # tl.dot needs tiles of at least 16
    while BP > 16 and B * H * triton.cdiv(P, BP) < tune["programs"]:
        BP //= 2
    where = dict(a=None, mask=None, cu_seqlens=None, parents=None, state_idx=None, rec_idx=None, A=None,
                 dt_bias=None, rB=None, sP=0) | where
    sS = state_strides if state_strides is not None else state.stride()
    # node tiles of at least 32: smaller trees in 16-node tiles ran slower than 32-node trees
    # (docs/tuning.md, "Mamba2 tree node tiles")
    _tree_verify_kernel[(B * H, triton.cdiv(P, BP))](
        x=x, dt=dt, Bm=Bm, Cm=Cm, D=D, S=state, y=y, u=u, G=G, sS_b=sS[0], sS_h=sS[1], sS_n=sS[2], sS_p=sS[3],
        H=H, NG=NG, N=N, P=P, BT=max(32, triton.next_power_of_2(steps)),
        BN=max(16, triton.next_power_of_2(N) if N <= tune["BN"] else tune["BN_split"]),
        BP=BP, D_HDIM=D.dim() == 2, DOT_PREC="ieee" if x.dtype == torch.float32 else tune["dot"],
        **_pending_kwargs(pending), **where, num_warps=tune["num_warps"], num_stages=tune["num_stages"],
    )


def own_rows(H: int, P: int, NG: int, N: int, T: int) -> dict:
    """The serial kernel's token and record placement for specla's own dense ``[B, T, ...]``
    tensors (sequence ``b``'s node ``t`` at row ``b * T + t``, records likewise), step sizes and
    log decays given."""
    return dict(cu_seqlens=None, A=None, dt_bias=None, rB=None, SX=H * P, SDT=H, SBC=NG * N, SY=H * P, RD=max(T, 1))


def _launch_serial(B: int, steps: int, x, dt, Bm, Cm, D, state, out, **where) -> None:
    """One launch of :func:`_serial_verify_kernel` over ``B`` chains of at most ``steps`` tokens,
    with ``TUNING["serial"]``'s tile and warps. ``out`` is ``(y, u, G)``; ``where`` gives the
    kernel's placement arguments (``a`` or ``A``/``dt_bias``, ``num_nodes``, ``pending``, the
    slots and strides); those left out are specla's own layout (:func:`own_rows`)."""
    H, P = x.shape[-2], x.shape[-1]
    NG, N = Bm.shape[-2], Bm.shape[-1]
    y, u, G = out
    tune = TUNING["serial"]
    BP = min(triton.next_power_of_2(P), tune["BP"])
    pending = where.pop("pending", None)
    where = own_rows(H, P, NG, N, steps) | dict(a=None, num_nodes=None) | where
    _serial_verify_kernel[(B * H, triton.cdiv(P, BP))](
        x=x, dt=dt, Bm=Bm, Cm=Cm, D=D, S=state, y=y, u=u, G=G, T=steps, H=H, NG=NG, N=N, P=P,
        BN=triton.next_power_of_2(N), BP=BP, D_HDIM=D.dim() == 2, **_pending_kwargs(pending), **where,
        num_warps=tune["num_warps"],
    )


def is_chain_batch(parents: Tensor, counts: Tensor) -> bool:
    """Whether the first ``counts[b]`` nodes of every row form a chain (node ``i`` is the child of
    node ``i - 1``); the rest of a row is padding (``parents`` alone cannot tell it from real
    root children, hence ``counts``)."""
    idx = torch.arange(parents.shape[1], device=parents.device)
    real = idx[None, :] < counts[:, None]
    return bool(((parents == idx - 1) | (idx == 0) | ~real).all())


def pick_verify_kernel(parents: Tensor, counts: Tensor, choice: str = "auto") -> str:
    """``serial`` / ``parallel`` / ``reference`` for a batch of trees (``counts``: real nodes per row).

    Chains -> serial (unless ``parallel`` is forced), trees up to ``MAX_TREE_NODES`` -> parallel,
    larger trees -> the reference path (Mamba2 has no hybrid kernel yet; ``hybrid`` picks as
    ``auto``).
    """
    if is_chain_batch(parents, counts) and choice != "parallel":
        return "serial"
    return "parallel" if parents.shape[1] <= MAX_TREE_NODES else "reference"
