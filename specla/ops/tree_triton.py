"""Triton twin of :func:`specla.tree.inclusive_ancestor_mask` (and the depths read from it): one
launch where the PyTorch form, a closure by repeated squaring, takes about fifteen small ones
(casts, batched products, comparisons, the row sums) in every verify pass of a recorded step,
which is bound by the number of kernels it launches. One program per tree climbs from every
node to the root, one parent per iteration.

Also the verify kernels' shared device helpers (GDN's, GLA's, KDA's and Mamba2's): where a
sequence's tokens lie (:func:`token_rows`; in a serial kernel :func:`chain_rows` and, token by
token, :func:`chain_step`) and its ancestor mask as a register tile (:func:`ancestor_mask_tile`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out


@triton.jit
def _ancestor_mask_kernel(parents, mask, depth, T, TP: tl.constexpr):
    """Tree ``b``: ``mask [b, i, j]`` = node ``j`` is ``i`` or an ancestor of ``i``; ``depth [b, i]``
    = its strict ancestors."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, TP)
    inside = i < T
    on = (i[:, None] == i[None, :]) & inside[:, None] & inside[None, :]
    cur = tl.load(parents + b * T + i, mask=inside, other=-1)
    count = tl.zeros([TP], dtype=tl.int64)
    for _ in range(T - 1):  # a path has at most T - 1 ancestors
        up = cur >= 0
        on = on | ((i[None, :] == cur[:, None]) & up[:, None])
        count += up.to(tl.int64)
        cur = tl.load(parents + b * T + cur, mask=up, other=-1)
    tl.store(mask + b * T * T + i[:, None] * T + i[None, :], on, mask=inside[:, None] & inside[None, :])
    tl.store(depth + b * T + i, count, mask=inside)


PLACEMENT = {"VARLEN": lambda args: args["cu_seqlens"] is not None,
             "ANC": lambda args: 0 if args["mask"] is not None else (1 if args["parents"] is not None else 2)}
"""Heuristics (``@triton.heuristics``) of a tree kernel's token rows (:func:`token_rows`) and
tree (:func:`ancestor_mask_tile`) from its ``cu_seqlens``, ``mask`` and ``parents`` arguments."""


@triton.jit
def token_rows(cu_seqlens, i_b, T, VARLEN: tl.constexpr):
    """In a tree kernel: the first token row and token count of sequence ``i_b``: ``b * T`` and
    ``T``, or from ``cu_seqlens`` (``VARLEN``)."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_b).to(tl.int64)
        n = (tl.load(cu_seqlens + i_b + 1) - bos).to(tl.int32)
    else:
        bos = i_b * T
        n = T
    return bos, n


CHAIN_PLACEMENT = {"VARLEN": PLACEMENT["VARLEN"], "OWN": lambda args: args["num_nodes"] is not None}
"""Heuristics of a serial (chain) kernel's token rows (:func:`chain_rows`) from its ``cu_seqlens``
and ``num_nodes`` arguments."""


@triton.jit
def chain_rows(cu_seqlens, num_nodes, i_b, T, VARLEN: tl.constexpr, OWN: tl.constexpr):
    """In a serial (chain) kernel: the first token row of sequence ``i_b`` and its token count, as
    :func:`token_rows`, the count ``num_nodes[i_b]`` instead where given (``OWN``: specla's own
    ``[B, T]`` rows, whose nodes past it are padding)."""
    bos, n = token_rows(cu_seqlens, i_b, T, VARLEN)
    if OWN:
        n = tl.load(num_nodes + i_b).to(tl.int32)
    return bos, n


@triton.jit
def chain_step(t, n, OWN: tl.constexpr):
    """In a serial kernel, token ``t`` of a row of ``n``: ``(valid, write)``, both ``[1]`` (a
    ``[1]`` load or store takes no scalar mask): whether it is one of the row's tokens, and
    whether its outputs are stored (specla's own rows store their padding nodes, as zeros; an
    engine's rows past a sequence's tokens are another's, or none)."""
    valid = (tl.zeros([1], dtype=tl.int32) + t) < n
    if OWN:
        write = valid | True
    else:
        write = valid
    return valid, write


@triton.jit
def ancestor_mask_tile(mask, parents, i_b, T, sP, o_t, m_t, ANC: tl.constexpr):
    """In a tree kernel: the inclusive-ancestor mask ``[BT, BT]`` of sequence ``i_b``'s nodes
    (``m_t``): loaded from ``mask`` (``ANC == 0``, ``[B, T, T]``), built from one parent index per
    node (``ANC == 1``: ``parents[i_b * sP + i]`` local, ``< i``; node 0 hangs from the state and
    its entry is not read; ``o_t`` spans at least 16 nodes, a power of two), or a chain
    (``ANC == 2``)."""
    m_tt = m_t[:, None] & m_t[None, :]
    if ANC == 0:
        b_M = tl.load(mask + i_b * T * T + o_t[:, None] * T + o_t[None, :], mask=m_tt, other=0) != 0
    elif ANC == 1:
        # each node's parent or itself, closed under ancestry by repeated squaring (after s
        # squarings every ancestor up to 2**s levels up): log2(BT) products on the tensor cores
        # instead of a serial pass per node, each a reduction over the tile; 0/1 entries and their
        # sums (at most BT) are exact in float16
        par = tl.load(parents + i_b * sP + o_t, mask=m_t & (o_t > 0), other=-1)
        b_R = tl.where(((o_t[:, None] == o_t[None, :]) | (o_t[None, :] == par[:, None])) & m_tt, 1.0, 0.0)
        for s in tl.static_range(7):  # BT <= 128
            if (1 << s) < o_t.shape[0]:
                b_R = tl.where(tl.dot(b_R.to(tl.float16), b_R.to(tl.float16)) > 0.5, 1.0, 0.0)
        b_M = b_R > 0.5
    else:
        b_M = (o_t[None, :] <= o_t[:, None]) & m_tt
    return b_M


@triton.jit
def ancestor_row(mask, parents, i_b, T, sP, i, n, o_t, ANC: tl.constexpr):
    """Row ``i`` of :func:`ancestor_mask_tile` for a sequence of ``n`` nodes, ``[BT]`` over
    ``o_t``: which nodes are ``i`` or its ancestors; none where ``i >= n``. From one parent index
    per node (``ANC == 1``) by climbing from ``i`` to the root, a parent an iteration (a kernel
    that needs one row per program builds no ``[BT, BT]`` tile)."""
    m_t = (o_t < n) & ((tl.zeros_like(o_t) + i) < n)  # a scalar mask would not broadcast
    if ANC == 0:
        on = tl.load(mask + i_b * T * T + i * T + o_t, mask=m_t, other=0) != 0
    elif ANC == 1:
        on = o_t == i
        # node 0 hangs from the state; past the nodes lie another sequence's entries, or none
        cur = tl.load(parents + i_b * sP + i, mask=(i > 0) & (i < n), other=-1).to(tl.int64)
        for _ in range(0, i):  # a path has at most i ancestors
            up = cur >= 0
            on = on | ((o_t == cur) & up)
            cur = tl.load(parents + i_b * sP + cur, mask=cur > 0, other=-1).to(tl.int64)
    else:
        on = o_t <= i
    return on & m_t


MAX_NODES = 128  # larger trees (no verify or prefill pass builds one): the twin


def ancestor_mask(parents: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The inclusive-ancestor mask and the depths of a batch of trees in one launch (up to
    :data:`MAX_NODES` nodes; the twin above).

    Args:
        parents: ``[B, T]`` int64, topologically ordered (``parents[b, i] < i``, ``-1`` = a root).
        out: optional preallocated contiguous ``(mask, depth)``.
    Returns:
        ``(mask [B, T, T]`` bool, as :func:`specla.tree.inclusive_ancestor_mask`,
        ``depth [B, T]`` int64, strict ancestors per node: ``mask.sum(-1) - 1``).
    Raises:
        ValueError: ``parents`` is not a ``[B, T]`` int64 tensor, or ``out`` is not contiguous
            tensors of the result's shapes and dtypes.
    """
    if parents.dim() != 2 or parents.dtype != torch.int64:
        raise ValueError(f"parents must be int64 [B, T], got {parents.dtype} {list(parents.shape)}")
    B, T = parents.shape
    if out is not None:
        check_out(out[:1], (B, T, T), (torch.bool,), parents.device)
        check_out(out[1:], (B, T), (torch.int64,), parents.device)
    if T > MAX_NODES:  # one program holds a [T, T] tile: larger trees take the twin
        from ..tree import inclusive_ancestor_mask

        ref = inclusive_ancestor_mask(parents)
        if out is None:
            return ref, ref.sum(-1) - 1
        out[0].copy_(ref)
        torch.sub(ref.sum(-1), 1, out=out[1])
        return out
    parents = parents.contiguous()
    mask, depth = out if out is not None else (torch.empty(B, T, T, dtype=torch.bool, device=parents.device),
                                               torch.empty(B, T, dtype=torch.int64, device=parents.device))
    if B and T:
        _ancestor_mask_kernel[(B,)](parents, mask, depth, T, TP=triton.next_power_of_2(T))
    return mask, depth
