"""Triton verify kernels for KDA (Kimi Delta Attention: the gated delta rule of docs/DESIGN.md
section 4 with GLA's per-key-channel decay, section 5).

``serial_verify``: the state-resident serial verify for chains. ``tree_verify``: the tree-masked
parallel verify for trees of up to 64 nodes. Both start with the fused delayed commit: one program
per (sequence, head, V tile) loads its state tile, applies the pending accepted path of the
previous step in closed form from its factor records (``S = diag(exp(Gk_a)) S + sum_j
diag(exp(Gk_a - Gk_j)) k_j delta_j^T``: GLA's commit with ``delta`` as the written values, so
GLA's :func:`specla.mixers.gla.verify._apply_pending` runs it), writes the committed state once,
then verifies from it, emitting outputs and this step's factor records (``delta`` and the
path-summed log decay ``Gk``). The state is never written with speculative tokens.

Per head, with ``q, k`` L2-normalised, ``q`` already scaled by ``K ** -0.5`` (as
:mod:`specla.mixers.kda.reference` takes it), ``g`` the per-channel log decay and ``beta`` the
write strength, each token does::

    S <- diag(exp(g)) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q

Runs on GPU, and on CPU under ``TRITON_INTERPRET=1`` (how CI tests it against ``reference.py``
and ``naive.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specla.mixers.gla.verify import MAX_TREE_NODES, _apply_pending, launch_decay
# KDAMixer's kernel rule (serial / parallel / reference): GLA's, whose kernels take the same forms
# (untimed for KDA)
from specla.mixers.gla.verify import pick_verify_kernel  # noqa: F401
from specla.ops.act_triton import softplus
from specla.ops.pending import check_layer_commit, own_slots, pending_launch, with_pending
from specla.ops.tree_triton import (
    CHAIN_PLACEMENT, PLACEMENT, ancestor_mask_tile, ancestor_row, chain_rows, chain_step, token_rows,
)
from specla.records import LayerCommit

from .records import KDAFactorRecord

PENDING_FIELDS = dict(pk="k", pv="delta", pGk="Gk")  # GLA's commit parameter -> KDAFactorRecord field
# the serial kernel's state-stride and layer-stride parameters (specla.ops.pending.own_slots)
SLOT_PARAMS = dict(strides=("sS_b", "sS_h", "sS_k", "sS_v"), layers=("lS", "lk", "ld", "lG"))
# Launch parameters. "serial": each program keeps a [K, BV] float32 state tile in registers;
# [128, 16] at Kimi Linear's K = 128 holds as many elements as GDN's serial tile [256, 8], past
# which that one spills; swept on the engines' chains (docs/tuning.md, "KDA serial kernel").
# "tree" (tiles and warps not swept): the state is visited in K blocks of BKC rows, so that
# nothing larger than a [BT, BKC] or [BT, BV] tile is live. "prepare": where the tree's matrices
# A and Q (the substitution's, :func:`_tree_verify_kernel`) come from: "separate", a prepare
# launch builds them once, a row a program, and every V tile loads them; "fused", every verify
# program builds them column by column, once per V tile. On the engines' data at Kimi-Linear-48B-A3B, TP 4,
# "separate" ran every tree of 8 to 64 nodes at batches 1 to 64 faster than "fused" and than
# SGLang's per-node kernel (docs/tuning.md, "KDA tree kernel"; benchmarks/engine_kernels.py
# --kda-tree-prepare times either).
TUNING = {"serial": {"BV": 16, "num_warps": 1},
          "tree": {"BV": 32, "BKC": 32, "num_warps": 4, "prepare": "separate"},
          "prepare": {"num_warps": 4}}
PREPARE_FORMS = ("fused", "separate")  # TUNING["tree"]["prepare"]


@with_pending
@triton.heuristics({"SLOTS": lambda args: args["state_idx"] is not None,
                    **CHAIN_PLACEMENT,
                    "RAW_GATES": lambda args: args["A_log"] is not None})
@triton.jit
def _serial_verify_kernel(
    q, k, v, g, beta, S, o, delta, Gk, num_nodes,
    pk, pv, pGk, path, path_len, state_idx, rec_idx, cu_seqlens, A_log, dt_bias, rk,
    scale, T, P, Tp, SQK, SV, SG, SGK, RD, sS_b, sS_h, sS_k, sS_v, path_step, lS, lk, ld, lG,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr, SLOTS: tl.constexpr, VARLEN: tl.constexpr,
    OWN: tl.constexpr, RAW_GATES: tl.constexpr, RAW_BETA: tl.constexpr, L2NORM: tl.constexpr,
):
    """Per (sequence, head, V tile[, layer]): fused delayed commit, then the chain token by token
    with the ``[BK, BV]`` state tile in registers.

    Where the data lies (specla's own calls use the first of each): ``num_nodes[b]`` tokens of
    sequence ``b`` at rows ``b * T + t`` (``OWN``: the nodes past them are padding and get zero
    outputs and records), or every row ``T`` tokens, or packed at ``cu_seqlens[b] + t``
    (``VARLEN``; rows past a sequence's tokens are not written); q and k rows ``SQK``, v rows
    ``SV``, beta rows ``SG``, g rows ``SGK`` elements apart, each row dense, o dense; the state of
    sequence ``b`` at slot ``b``, or ``state_idx[b]`` (``SLOTS``; a negative slot is neither read
    nor written), element ``(h, k, v)`` at ``h sS_h + k sS_k + v sS_v``; the records ``delta``,
    ``Gk`` (and the keys into ``rk``, when given) of node ``t`` at row ``r * RD + t``, ``r = b``
    or ``rec_idx[b]`` (a negative row writes none, and its outputs are zero, as the tree
    kernel's); the pending records of node ``path[b, j] - b * path_step``; ``g`` given or raw
    (``RAW_GATES``: ``g = -exp(A_log[h]) softplus(g + dt_bias[h, c])``), ``beta`` given or raw
    (``RAW_BETA``: ``sigmoid``); ``L2NORM``: q and k L2-normalised here; q is scaled by
    ``scale`` (specla's own calls: 1, q comes scaled). A third grid axis runs one commit per
    layer (``T = 0``): layer ``l``'s state and records lie ``l lS``, ``l lk``, ``l ld``, ``l lG``
    elements on."""
    i_v, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    S += i_l * lS
    if HAS_PENDING:
        pk += i_l * lk
        pv += i_l * ld
        pGk += i_l * lG
    i_b, i_h = i_bh // H, i_bh % H
    if SLOTS:
        slot = tl.load(state_idx + i_b).to(tl.int64)
        i_r = tl.load(rec_idx + i_b).to(tl.int64)
    else:
        slot, i_r = i_b, i_b
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :] & (slot >= tl.zeros([1, BV], dtype=tl.int64))
    p_S = S + slot * sS_b + i_h * sS_h + o_k[:, None] * sS_k + o_v[None, :] * sS_v
    b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
    if HAS_PENDING:  # fused delayed commit: the committed state is written once
        b_S = _apply_pending(b_S, p_S, m_s, pk, pv, pGk, path, path_len, i_b, i_r, i_b * path_step, i_h, o_k, o_v,
                             m_k, m_v, P, Tp, H, K, V)
    bos, n = chain_rows(cu_seqlens, num_nodes, i_b, T, VARLEN, OWN)
    if RAW_GATES:
        b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_A = -tl.exp(tl.load(A_log + i_h + tl.zeros([1], dtype=tl.int64)).to(tl.float32))
    has_row = (tl.zeros([1], dtype=tl.int64) + i_r) >= 0  # [1], as the masks it joins
    b_G = tl.zeros([BK], dtype=tl.float32)
    for t in range(0, T):
        tok = bos + t
        valid, write = chain_step(t, n, OWN)
        qk = tok * SQK + i_h * K + o_k
        b_q = tl.load(q + qk, mask=m_k & valid, other=0.0).to(tl.float32)
        b_k = tl.load(k + qk, mask=m_k & valid, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q * (scale / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6))
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        else:
            b_q = b_q * scale
        b_vv = tl.load(v + tok * SV + i_h * V + o_v, mask=m_v & valid, other=0.0).to(tl.float32)
        b_g = tl.load(g + tok * SGK + i_h * K + o_k, mask=m_k & valid, other=0.0).to(tl.float32)
        if RAW_GATES:
            b_g = tl.where(m_k, b_A * softplus(b_g + b_bias), 0.0)
        b_beta = tl.load(beta + tok * SG + i_h + tl.zeros([1], dtype=tl.int64), mask=valid, other=0.0).to(tl.float32)
        if RAW_BETA:
            b_beta = tl.sigmoid(b_beta)
        S_dec = b_S * tl.exp(b_g)[:, None]
        b_d = b_beta * (b_vv - tl.sum(S_dec * b_k[:, None], 0))
        S_new = S_dec + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(S_new * b_q[:, None], 0)
        b_S = tl.where(valid, S_new, b_S)
        b_G = tl.where(valid, b_G + b_g, b_G)
        rec = i_r * RD + t
        tl.store(o + (tok * H + i_h) * V + o_v, tl.where(valid & has_row, b_o, 0.0).to(o.dtype.element_ty),
                 mask=m_v & write)
        tl.store(delta + (rec * H + i_h) * V + o_v, tl.where(valid, b_d, 0.0), mask=m_v & write & has_row)
        if i_v == 0:
            tl.store(Gk + (rec * H + i_h) * K + o_k, tl.where(valid, b_G, 0.0), mask=m_k & write & has_row)
            if rk is not None:  # the records' keys, normalised
                tl.store(rk + (rec * H + i_h) * K + o_k, b_k, mask=m_k & write & has_row)


@triton.heuristics(PLACEMENT)
@triton.jit
def _tree_prepare_kernel(
    q, k, beta, mask, Gk, Am, Qm, cu_seqlens, parents, rec_idx,
    scale, T, SQK, SG, D, sP,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKC: tl.constexpr,
    VARLEN: tl.constexpr, ANC: tl.constexpr, RAW_BETA: tl.constexpr, L2NORM: tl.constexpr,
):
    """Per (sequence, head, node ``i``): row ``i`` of the substitution's matrices of
    :func:`_tree_verify_kernel`, for all its V tiles, into ``Am``, ``Qm`` ``[B * H, BT, BT]``
    float32 (row ``i``, every column written; zero off ``i``'s root path and past the nodes)::

        A[i, j] = beta_i sum_c k_i[c] k_j[c] exp(Gk_i[c] - Gk_j[c])   (j a strict ancestor of i)
        Q[i, j] = sum_c q_i[c] k_j[c] exp(Gk_i[c] - Gk_j[c])          (j on i's root path)

    with q, k normalised and q scaled as the verify kernel does; the exponent is masked before
    ``exp`` (off-path pairs would be exp(positive)). ``Gk`` is the decay kernel's; data placement
    as the verify kernel's."""
    i_bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    bos, n = token_rows(cu_seqlens, i_b, T, VARLEN)
    if rec_idx is not None:
        row = tl.load(rec_idx + i_b).to(tl.int64)
    else:
        row = i_b
    m_t = o_t < n
    tok = bos + o_t
    rec = row * D + o_t
    m_rec = m_t & (row >= tl.zeros([BT], dtype=tl.int64))  # a scalar mask would not broadcast
    on = ancestor_row(mask, parents, i_b, T, sP, i, n, o_t, ANC)
    acc_a = tl.zeros([BT], dtype=tl.float32)
    acc_q = tl.zeros([BT], dtype=tl.float32)
    ssq_j = tl.zeros([BT], dtype=tl.float32)
    ssq_qi = tl.zeros([BKC], dtype=tl.float32)
    ssq_ki = tl.zeros([BKC], dtype=tl.float32)
    for kb in range(0, K, BKC):
        o_k = kb + tl.arange(0, BKC)
        m_k = o_k < K
        m_i = m_k & ((tl.zeros_like(o_k) + i) < n)  # a scalar mask would not broadcast
        k_j = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        G_j = tl.load(Gk + (rec[:, None] * H + i_h) * K + o_k[None, :], mask=m_rec[:, None] & m_k[None, :],
                      other=0.0)
        k_i = tl.load(k + (bos + i) * SQK + i_h * K + o_k, mask=m_i, other=0.0).to(tl.float32)
        q_i = tl.load(q + (bos + i) * SQK + i_h * K + o_k, mask=m_i, other=0.0).to(tl.float32)
        G_i = tl.load(Gk + ((row * D + i) * H + i_h) * K + o_k, mask=m_i & (row >= tl.zeros([BKC], dtype=tl.int64)),
                      other=0.0)
        kw = k_j * tl.where(on[:, None], tl.exp(tl.where(on[:, None], G_i[None, :] - G_j, 0.0)), 0.0)
        acc_a += tl.sum(kw * k_i[None, :], 1)
        acc_q += tl.sum(kw * q_i[None, :], 1)
        if L2NORM:
            ssq_j += tl.sum(k_j * k_j, 1)
            ssq_qi += q_i * q_i
            ssq_ki += k_i * k_i
    r_j = tl.full([BT], 1.0, dtype=tl.float32)
    r_qi = scale
    r_ki = 1.0
    if L2NORM:
        r_j = 1.0 / tl.sqrt(ssq_j + 1e-6)
        r_qi = scale / tl.sqrt(tl.sum(ssq_qi, 0) + 1e-6)
        r_ki = 1.0 / tl.sqrt(tl.sum(ssq_ki, 0) + 1e-6)
    b_beta = 0.0
    if i < n:
        b_beta = tl.load(beta + (bos + i) * SG + i_h).to(tl.float32)
        if RAW_BETA:
            b_beta = tl.sigmoid(b_beta)
    b_A = tl.where(on & (o_t != i), b_beta * r_ki * r_j * acc_a, 0.0)
    b_Q = tl.where(on, r_qi * r_j * acc_q, 0.0)
    tl.store(Am + (i_bh * BT + i) * BT + o_t, b_A)
    tl.store(Qm + (i_bh * BT + i) * BT + o_t, b_Q)


@with_pending
@triton.heuristics({"SLOTS": lambda args: args["state_idx"] is not None,
                    "PREPARED": lambda args: args["Am"] is not None, **PLACEMENT})
@triton.jit
def _tree_verify_kernel(
    q, k, v, beta, mask, Gk, S, o, delta,
    pk, pv, pGk, path, path_len,
    cu_seqlens, parents, state_idx, rec_idx, rk, Am, Qm,
    scale, T, P, Tp, SV, SQK, SG, D, sP, sS_b, sS_h, sS_k, sS_v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, HAS_PENDING: tl.constexpr,
    VARLEN: tl.constexpr, SLOTS: tl.constexpr, ANC: tl.constexpr, RAW_BETA: tl.constexpr, L2NORM: tl.constexpr,
    PREPARED: tl.constexpr,
):
    """Per (sequence, head, V tile), from ``Gk`` (:func:`_tree_decay_kernel`'s launch): the state
    visited in K blocks of ``BKC`` rows, each block committed (fused, written once) and then
    contributing to ``(exp(Gk) * k) S0`` and ``(exp(Gk) * q) S0``; then ``delta`` by forward
    substitution column by column, ancestors first (a node's ancestors have lower indices)::

        delta  = beta v - beta (exp(Gk) * k) S0;  for each node j, once delta_j is final:
        delta_i -= A[i, j] delta_j,   o_i += Q[i, j] delta_j     (o from (exp(Gk) * q) S0)

    with ``W[i, j, c] = exp(Gk_i[c] - Gk_j[c])`` on ancestor pairs (the exponent masked before
    ``exp``), ``A[i, j] = beta_i sum_c k_i[c] k_j[c] W[i, j, c]`` for ``j`` a strict ancestor of
    ``i`` and ``Q[i, j] = sum_c q_i[c] k_j[c] W[i, j, c]`` for ``j`` on ``i``'s root path.

    Where the data lives (specla's own calls use the first of each): tokens of sequence ``b`` at
    rows ``b * T + t`` or packed at ``cu_seqlens[b] + t`` (``VARLEN``), q and k rows ``SQK``, v
    rows ``SV``, beta rows ``SG`` elements apart, o dense; the ancestors from ``mask``, one parent
    index per node or a chain (``ANC``, :func:`specla.ops.tree_triton.ancestor_mask_tile`); the
    state of sequence ``b`` at slot ``b`` or ``state_idx[b]`` (``SLOTS``; a negative slot reads a
    zero state), element ``(h, k, v)`` at ``h sS_h + k sS_k + v sS_v``; ``Gk``, ``delta`` (and
    the keys ``rk``, when given) of node ``t`` at row ``r * D + t``, ``r = b`` or ``rec_idx[b]``
    (a negative row has no records: no ``delta`` is written and its outputs are zero); ``beta``
    given or raw (``RAW_BETA``: ``sigmoid`` here); ``L2NORM``: q and k L2-normalised here; q is
    scaled by ``scale`` (specla's own calls: 1, q comes scaled). ``PREPARED``: ``A`` and ``Q``
    loaded from :func:`_tree_prepare_kernel`'s ``Am``, ``Qm`` instead of built here, and
    ``o += Q delta`` one product after the substitution."""
    i_v, i_bh = tl.program_id(1), tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
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
    r_q = tl.full([BT], 1.0, dtype=tl.float32) * scale  # each row's factor on q and on k
    r_k = tl.full([BT], 1.0, dtype=tl.float32)
    if L2NORM:
        ssq_q = tl.zeros([BT], dtype=tl.float32)
        ssq_k = tl.zeros([BT], dtype=tl.float32)
        for kb in range(0, K, BKC):
            o_k = kb + tl.arange(0, BKC)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            ssq_q += tl.sum(b_q * b_q, 1)
            ssq_k += tl.sum(b_k * b_k, 1)
        r_q = scale / tl.sqrt(ssq_q + 1e-6)
        r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    b_kS = tl.zeros([BT, BV], dtype=tl.float32)
    b_qS = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in range(0, K, BKC):
        o_k = kb + tl.arange(0, BKC)
        m_k = o_k < K
        m_s = m_k[:, None] & m_v[None, :] & (slot >= tl.zeros([1, BV], dtype=tl.int64))
        m_tk = m_t[:, None] & m_k[None, :]
        p_S = S + slot * sS_b + i_h * sS_h + o_k[:, None] * sS_k + o_v[None, :] * sS_v
        b_S = tl.load(p_S, mask=m_s, other=0.0).to(tl.float32)
        if HAS_PENDING:
            b_S = _apply_pending(b_S, p_S, m_s, pk, pv, pGk, path, path_len, i_b, i_b, 0, i_h, o_k, o_v, m_k, m_v,
                                 P, Tp, H, K, V)
        # exp(Gk) <= 1: no overflow
        e_G = tl.exp(tl.load(Gk + (rec[:, None] * H + i_h) * K + o_k[None, :], mask=m_rec[:, None] & m_k[None, :],
                             other=0.0))
        b_q = tl.load(q + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_kS += tl.dot(b_k * r_k[:, None] * e_G, b_S, input_precision="ieee")
        b_qS += tl.dot(b_q * r_q[:, None] * e_G, b_S, input_precision="ieee")
    b_v = tl.load(v + tok[:, None] * SV + i_h * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                  other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * SG + i_h, mask=m_t, other=0.0).to(tl.float32)
    if RAW_BETA:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    b_d = b_beta[:, None] * (b_v - b_kS)
    b_o = b_qS
    if PREPARED:
        p_A = i_bh * BT * BT + o_t[:, None] * BT + o_t[None, :]
        b_A = tl.load(Am + p_A)
        for j in range(0, n):
            a_j = tl.sum(tl.where(o_t[None, :] == j, b_A, 0.0), 1)  # column j of A: zero on j's row
            d_j = tl.sum(tl.where(o_t[:, None] == j, b_d, 0.0), 0)  # node j's delta: its ancestors are done
            b_d -= a_j[:, None] * d_j[None, :]
        b_o += tl.dot(tl.load(Qm + p_A), b_d, input_precision="ieee")
    else:
        b_M = ancestor_mask_tile(mask, parents, i_b, T, sP, o_t, m_t, ANC).to(tl.int32)
        for j in range(0, n):
            on = tl.sum(tl.where(o_t[None, :] == j, b_M, 0), 1) > 0  # is j on path(i)?
            r_kj = tl.sum(tl.where(o_t == j, r_k, 0.0), 0)
            b_a = tl.zeros([BT], dtype=tl.float32)
            b_qk = tl.zeros([BT], dtype=tl.float32)
            for kb in range(0, K, BKC):
                o_k = kb + tl.arange(0, BKC)
                m_k = o_k < K
                m_tk = m_t[:, None] & m_k[None, :]
                b_G = tl.load(Gk + (rec[:, None] * H + i_h) * K + o_k[None, :], mask=m_rec[:, None] & m_k[None, :],
                              other=0.0)
                G_j = tl.load(Gk + ((row * D + j) * H + i_h) * K + o_k,
                              mask=m_k & (row >= tl.zeros([BKC], dtype=tl.int64)), other=0.0)
                k_j = tl.load(k + (bos + j) * SQK + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32) * r_kj
                # mask the exponent before exp: off-path pairs would be exp(positive)
                kw = k_j[None, :] * tl.where(on[:, None], tl.exp(tl.where(on[:, None], b_G - G_j[None, :], 0.0)), 0.0)
                b_a += tl.sum(tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(
                    tl.float32) * kw, 1) * r_k
                b_qk += tl.sum(tl.load(q + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(
                    tl.float32) * kw, 1) * r_q
            d_j = tl.sum(tl.where(o_t[:, None] == j, b_d, 0.0), 0)  # node j's delta: its ancestors are done
            b_d -= tl.where(o_t != j, b_beta * b_a, 0.0)[:, None] * d_j[None, :]
            b_o += b_qk[:, None] * d_j[None, :]
    b_o = tl.where(m_rec[:, None], b_o, 0.0)
    tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])
    tl.store(delta + (rec[:, None] * H + i_h) * V + o_v[None, :], b_d, mask=m_rec[:, None] & m_v[None, :])
    if rk is not None:  # the records' keys, normalised
        if i_v == 0:
            for kb in range(0, K, BKC):
                o_k = kb + tl.arange(0, BKC)
                m_tk = m_rec[:, None] & (o_k < K)[None, :]
                b_k = tl.load(k + tok[:, None] * SQK + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
                tl.store(rk + (rec[:, None] * H + i_h) * K + o_k[None, :], b_k * r_k[:, None], mask=m_tk)


def _check(q, k, v, g, beta, state, pending) -> None:
    """Shapes, dtypes and devices shared by the verify kernels (raises ValueError)."""
    B, T, H, K = k.shape
    if q.shape != k.shape or v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    V = v.shape[3]
    for name, x, shape in (("g", g, (B, T, H, K)), ("beta", beta, (B, T, H)), ("state", state, (B, H, K, V))):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {list(x.shape)}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (the committed state is written in place)")
    if len({x.device for x in [q, k, v, g, beta, state, *(pending.tensors() if pending else [])]}) != 1:
        raise ValueError("all tensors must be on one device")
    if pending is not None:
        _check_pending(B, H, K, V, pending)


def _check_pending(B, H, K, V, pending: LayerCommit) -> None:
    """A pending commit's factor records and path must match the state's shape (ValueError)."""
    check_layer_commit(pending, KDAFactorRecord, B, dict(k=(H, K), delta=(H, V), Gk=(H, K)),
                       float32=("delta", "Gk"))


def _pending_kwargs(pending: LayerCommit | None) -> dict:
    """The launch's keyword arguments of an optional pending commit (:mod:`specla.ops.pending`)."""
    return pending_launch(pending, PENDING_FIELDS)


def _outputs(v: Tensor, K: int, out):
    """``(o, delta, Gk)``: ``out``, or new tensors."""
    B, T, H, V = v.shape
    if out is None:
        out = (torch.empty_like(v), torch.empty(B, T, H, V, dtype=torch.float32, device=v.device),
               torch.empty(B, T, H, K, dtype=torch.float32, device=v.device))
    return out


def serial_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, num_nodes: Tensor,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """State-resident serial verify of a batch of chains, with the fused delayed commit.

    Node ``t`` of sequence ``b`` is the child of node ``t - 1`` (node 0 hangs from the committed
    state); nodes ``t >= num_nodes[b]`` are padding and get zero outputs and records.

    Args:
        q, k: ``[B, T, H, K]`` L2-normalised queries (scaled by ``K ** -0.5``) and keys (float32
            or bfloat16).
        v: ``[B, T, H, V]`` (float32 or bfloat16).
        g: ``[B, T, H, K]`` float32 per-channel log decay; beta: ``[B, T, H]`` float32.
        state: ``[B, H, K, V]`` float32 committed state; the pending commit, if any, is applied
            to it **in place** (and nothing else is written to it).
        num_nodes: ``[B]`` int64 chain length per sequence (``0..T``).
        pending: the previous step's commit, :class:`specla.records.LayerCommit` of a
            ``KDAFactorRecord`` (``k [B, Tp, H, K]``, ``delta [B, Tp, H, V]`` float32, ``Gk [B,
            Tp, H, K]`` float32), ``path [B, P]`` and ``path_len [B]`` int64; ``path_len[b] = 0``
            leaves sequence ``b``'s state bit-identical (not even written).
        out: optional preallocated ``(o, delta, Gk)`` (tests pass NaN-filled tensors).
    Returns:
        ``o [B, T, H, V]`` (``v.dtype``), ``delta [B, T, H, V]`` float32 and ``Gk [B, T, H, K]``
        float32 (path-summed log decay): with ``k``, the factor record
        (:class:`specla.mixers.kda.records.KDAFactorRecord`).
    Raises:
        ValueError: shapes, dtypes or devices disagree (checked before any launch).
    """
    B, T, H, K = k.shape
    _check(q, k, v, g, beta, state, pending)
    if num_nodes.shape != (B,) or num_nodes.dtype != torch.int64 or num_nodes.device != k.device:
        raise ValueError(f"num_nodes must be int64 [{B}] on {k.device}, got {num_nodes.dtype} {list(num_nodes.shape)}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = _outputs(v, K, out)
    _launch_serial(B, T, q, k, v, g, beta, state, out, num_nodes=num_nodes, pending=pending,
                   **own_slots(state, **SLOT_PARAMS))
    return out


def own_rows(H: int, K: int, V: int, T: int) -> dict:
    """The serial kernel's token and record placement for specla's own dense ``[B, T, ...]``
    tensors (sequence ``b``'s node ``t`` at row ``b * T + t``, records likewise), gates, beta and
    normalised, scaled q and k given."""
    return dict(cu_seqlens=None, A_log=None, dt_bias=None, rk=None, scale=1.0, SQK=H * K, SV=H * V, SG=H, SGK=H * K,
                RD=max(T, 1), RAW_BETA=False, L2NORM=False)


def _launch_serial(B: int, steps: int, q, k, v, g, beta, state, out, **where) -> None:
    """One launch of :func:`_serial_verify_kernel` over ``B`` chains of at most ``steps`` tokens,
    with ``TUNING["serial"]``'s tile and warps. ``out`` is ``(o, delta, Gk)``; ``where`` gives the
    kernel's placement arguments (``num_nodes``, ``pending``, the raw inputs, slots and strides);
    those left out are specla's own layout (:func:`own_rows`)."""
    H, K = k.shape[-2:]
    V = v.shape[-1]
    o, d, G = out
    BV = min(triton.next_power_of_2(V), TUNING["serial"]["BV"])
    pending = where.pop("pending", None)
    where = own_rows(H, K, V, steps) | dict(num_nodes=None) | where
    _serial_verify_kernel[(B * H, triton.cdiv(V, BV))](
        q=q, k=k, v=v, g=g, beta=beta, S=state, o=o, delta=d, Gk=G, T=steps, H=H, K=K, V=V,
        BK=triton.next_power_of_2(K), BV=BV, **_pending_kwargs(pending), **where,
        num_warps=TUNING["serial"]["num_warps"],
    )


def tree_verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, mask: Tensor,
    pending: LayerCommit | None = None,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree-masked parallel verify of a batch of trees, with the fused delayed commit.

    Args:
        q, k, v, g, beta, state, pending, out: as :func:`serial_verify`.
        mask: ``[B, T, T]`` bool inclusive-ancestor mask (``specla.tree.inclusive_ancestor_mask``)
            of nodes in topological order (a parent's index below its child's), ``T <= 64``.
    Returns:
        ``o [B, T, H, V]`` (``v.dtype``), ``delta [B, T, H, V]`` float32 and ``Gk [B, T, H, K]``
        float32, every node as if its root path had been decoded serially from the committed
        state.
    Raises:
        ValueError: shapes, dtypes, devices disagree, or ``T > 64``.
    Formula: :func:`specla.mixers.kda.reference.tree_kda`. ``Gk = M_incl @ g`` is computed once
    per (sequence, head) by GLA's decay kernel and shared by all V tiles; products in float32
    ("ieee").
    """
    B, T, H, K = k.shape
    _check(q, k, v, g, beta, state, pending)
    if mask.shape != (B, T, T) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{B}, {T}, {T}], got {mask.dtype} {list(mask.shape)}")
    if T > MAX_TREE_NODES:
        raise ValueError(f"tree_verify handles at most {MAX_TREE_NODES} nodes, got {T}")
    q, k, v, g, beta, mask = (x.contiguous() for x in (q, k, v, g, beta, mask))
    out = _outputs(v, K, out)
    _launch_tree(B, T, q, k, v, g, beta, state, out, mask=mask, pending=pending)
    return out


def _launch_tree(B, steps, q, k, v, g, beta, state, out, *, pending=None, state_strides=None, **where):
    """The tree verify of ``B`` sequences of at most ``steps`` nodes: GLA's decay kernel for
    ``Gk``, then :func:`_tree_verify_kernel`. ``out`` is ``(o, delta, Gk)``; ``g`` the log decays
    or, with ``A_log``/``dt_bias`` in ``where``, the raw gate inputs; ``where`` gives the kernels'
    data-placement arguments (``mask``/``parents``, ``cu_seqlens``, ``state_idx``, ``rec_idx``,
    ``A_log``/``dt_bias``, ``rk``, ``scale``, ``RAW_BETA``, ``L2NORM``, the strides and sizes
    ``T``, ``SQK``, ``SV``, ``SG``, ``SGK`` (of ``g``), ``D``, ``sP``); those left out are
    specla's own layout; ``state_strides`` (slot, head, k, v) defaults to ``state``'s."""
    H, K = k.shape[-2:]
    V = v.shape[-1]
    o, d, G = out
    BT = max(16, triton.next_power_of_2(steps))  # tl.dot takes no side under 16
    tune = TUNING["tree"]
    BKC = max(16, min(triton.next_power_of_2(K), tune["BKC"]))
    BV = max(16, min(triton.next_power_of_2(V), tune["BV"]))
    T = where.pop("T", steps)
    where = dict(mask=None, cu_seqlens=None, parents=None, state_idx=None, rec_idx=None, rk=None, scale=1.0, SQK=H * K,
                 SV=H * V, SG=H, SGK=H * K, D=T, sP=0, RAW_BETA=False, L2NORM=False) | where
    A_log, dt_bias, SGK = where.pop("A_log", None), where.pop("dt_bias", None), where.pop("SGK")
    if tune["prepare"] not in PREPARE_FORMS:  # before any launch writes an output
        raise ValueError(f'TUNING["tree"]["prepare"] must be one of {", ".join(map(repr, PREPARE_FORMS))}, '
                         f'got {tune["prepare"]!r}')
    place = {name: where[name] for name in ("mask", "cu_seqlens", "parents", "rec_idx", "D", "sP")}
    launch_decay(B, g, G, T, H, K, BT, max(16, triton.next_power_of_2(K)), A_log=A_log, dt_bias=dt_bias, SG=SGK,
                 **place)
    Am = Qm = None
    if tune["prepare"] == "separate":
        Am, Qm = torch.empty(2, B * H, BT, BT, dtype=torch.float32, device=v.device)
        _tree_prepare_kernel[(B * H, BT)](
            q=q, k=k, beta=beta, Gk=G, Am=Am, Qm=Qm, T=T, H=H, K=K, BT=BT, BKC=BKC, **place,
            **{name: where[name] for name in ("scale", "SQK", "SG", "RAW_BETA", "L2NORM")},
            num_warps=TUNING["prepare"]["num_warps"],
        )
    sS = state_strides if state_strides is not None else state.stride()
    _tree_verify_kernel[(B * H, triton.cdiv(V, BV))](
        q=q, k=k, v=v, beta=beta, Gk=G, S=state, o=o, delta=d, T=T, sS_b=sS[0], sS_h=sS[1], sS_k=sS[2], sS_v=sS[3],
        H=H, K=K, V=V, BT=BT, BKC=BKC, BV=BV, Am=Am, Qm=Qm, **_pending_kwargs(pending), **where,
        num_warps=tune["num_warps"],
    )
