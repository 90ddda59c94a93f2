"""Triton tree short-convolution kernels (docs/DESIGN.md section 4, short convolution), shared by
the plugins.

``tree_conv``: node ``i`` convolves the inputs of its last ``C - 1`` ancestors (crossing into the
committed window) and itself, then SiLU. ``conv_commit``: the window after an accepted path, its
last ``C - 1`` inputs. Indices come from ``conv_ancestors`` (a [B, T, C] table into ``[window ;
x]``, one launch; twin ``specla.ops.conv.conv_ancestors``), so both kernels are pure gathers plus
a ``C``-tap dot product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out

# tree_conv's programs: one node by ``BD`` channels while a pass has at most ``node_programs``
# nodes in all, else tiles of up to ``rows`` nodes of one sequence by at most ``tile`` elements:
# tiles win on large tree passes, one node a program on one-token passes and small batches
# (docs/tuning.md, "Short-convolution programs").
TUNING = {"node_programs": 64, "rows": 16, "BD": 256, "tile": 2048}


@triton.jit
def _conv_ancestors_kernel(parents, anc, T, W: tl.constexpr, C: tl.constexpr):
    # program (b, t): walk up from the node, C - 1 steps, in [window ; nodes] indices
    i = tl.program_id(0).to(tl.int64)
    b = i // T
    e = W + i % T
    tl.store(anc + i * C + C - 1, e)
    for c in tl.static_range(C - 1):
        p = tl.load(parents + b * T + tl.maximum(e - W, 0), mask=e >= W, other=-1)
        node_parent = tl.where(p >= 0, p + W, W - 1)
        e = tl.maximum(tl.where(e >= W, node_parent, e - 1), 0)
        tl.store(anc + i * C + C - 2 - c, e)


def conv_ancestors(parents: Tensor, width: int, out: Tensor | None = None) -> Tensor:
    """``specla.ops.conv.conv_ancestors`` in one launch: each node's last ``width`` inputs along
    its root path, as indices into ``[window ; x]``.

    Args:
        parents: ``[B, T]`` int64, ``-1`` = child of the committed state; width: conv width ``C``
            (``>= 1``); out: optional preallocated ``[B, T, C]`` int64 contiguous.
    Returns:
        ``[B, T, C]`` int64 (column ``C - 1`` the node itself; ``out`` when given).
    Raises:
        ValueError: ``parents`` not a 2-D int64 tensor, ``width < 1``, or ``out`` of another
            shape, dtype, device or layout.
    """
    if parents.dim() != 2 or parents.dtype != torch.int64 or width < 1:
        raise ValueError(f"conv_ancestors: parents int64 [B, T] and width >= 1 expected, got {parents.dtype} "
                         f"{list(parents.shape)} and width {width}")
    B, T = parents.shape
    anc = torch.empty(B, T, width, dtype=torch.int64, device=parents.device) if out is None else out
    if anc.shape != (B, T, width) or anc.dtype != torch.int64 or anc.device != parents.device or not anc.is_contiguous():
        raise ValueError(f"conv_ancestors: out must be int64 [{B}, {T}, {width}] contiguous on {parents.device}, got "
                         f"{anc.dtype} {list(anc.shape)} on {anc.device}")
    if B * T:
        _conv_ancestors_kernel[(B * T,)](parents.contiguous(), anc, T, W=width - 1, C=width)
    return anc


@triton.jit
def _tree_conv_kernel(x, window, weight, bias, anc, y, T, D, sxb, sxt, W: tl.constexpr, C: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr):
    # one program per (sequence, block of BT nodes, block of BD channels)
    i_d, i_bt = tl.program_id(1), tl.program_id(0).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    if BT == 1:  # one node: scalar indices, both sources read at clamped (valid) rows, then selected
        i_b = i_bt // T
        acc = tl.zeros([BD], dtype=tl.float32)
        for c in tl.static_range(C):
            e = tl.load(anc + i_bt * C + c)  # index into [window ; x]
            xw = tl.load(window + (i_b * W + tl.maximum(tl.minimum(e, W - 1), 0)) * D + o_d, mask=m_d & (W > 0),
                         other=0.0)
            xx = tl.load(x + i_b * sxb + tl.maximum(e - W, 0) * sxt + o_d, mask=m_d, other=0.0)
            w = tl.load(weight + o_d * C + c, mask=m_d, other=0.0).to(tl.float32)
            acc += w * tl.where(e < W, xw.to(tl.float32), xx.to(tl.float32))
        if HAS_BIAS:
            acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        out = acc * tl.sigmoid(acc)
        tl.store(y + i_bt * D + o_d, out.to(y.dtype.element_ty), mask=m_d)
    else:  # a [BT, BD] tile: each element read from its one source
        n_t = tl.cdiv(T, BT)
        i_b, i_t = i_bt // n_t, i_bt % n_t
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m = m_t[:, None] & m_d[None, :]
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for c in tl.static_range(C):
            e = tl.load(anc + (i_b * T + o_t) * C + c, mask=m_t, other=W)
            from_win = (e < W)[:, None]
            xw = tl.load(window + (i_b * W + tl.maximum(tl.minimum(e, W - 1), 0))[:, None] * D + o_d[None, :],
                         mask=m & from_win, other=0.0)
            xx = tl.load(x + i_b * sxb + tl.maximum(e - W, 0)[:, None] * sxt + o_d[None, :], mask=m & ~from_win,
                         other=0.0)
            w = tl.load(weight + o_d * C + c, mask=m_d, other=0.0).to(tl.float32)
            acc += w[None, :] * (xw.to(tl.float32) + xx.to(tl.float32))
        if HAS_BIAS:
            acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(y + (i_b * T + o_t)[:, None] * D + o_d[None, :], out.to(y.dtype.element_ty), mask=m)


@triton.jit
def _conv_commit_kernel(x, window, path, path_len, new, T, P, D, sxb, sxt, W: tl.constexpr, WP: tl.constexpr,
                        BD: tl.constexpr):
    # one program owns every slot of its sequence's column block and loads them all before it
    # stores: ``new`` may be ``window`` itself (slot s reads slot path_len + s)
    i_d, i_b = tl.program_id(1), tl.program_id(0).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    slot = tl.arange(0, WP)
    m = (slot < W)[:, None] & (o_d < D)[None, :]
    pos = tl.load(path_len + i_b) + slot  # position in [window ; path inputs]
    from_win = pos < W
    node = tl.load(path + i_b * P + tl.maximum(tl.minimum(pos - W, P - 1), 0), mask=slot < W, other=0)
    xw = tl.load(window + (i_b * W + tl.minimum(pos, W - 1))[:, None] * D + o_d[None, :], mask=m, other=0.0)
    xx = tl.load(x + i_b * sxb + tl.maximum(node, 0)[:, None] * sxt + o_d[None, :], mask=m, other=0.0)
    # a slot is loaded and stored by different threads: every load before any store (in place)
    tl.debug_barrier()
    tl.store(new + (i_b * W + slot)[:, None] * D + o_d[None, :], tl.where(from_win[:, None], xw, xx), mask=m)


def tree_conv(x: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, anc: Tensor,
              out: Tensor | None = None) -> Tensor:
    """Tree-aware causal short convolution + SiLU (Triton twin of ``specla.ops.conv.tree_conv``).

    Args:
        x: ``[B, T, D]`` node inputs (any strides; rows may be a slice of a wider projection);
        window: ``[B, C - 1, D]`` committed inputs (oldest first); weight: ``[D, C]``; bias:
        ``[D]`` or None; anc: ``[B, T, C]`` int64 from ``specla.ops.conv.conv_ancestors``; out:
        optional preallocated contiguous ``[B, T, D]`` in ``x.dtype``.
    Returns:
        ``[B, T, D]`` contiguous, in ``x.dtype`` (accumulated in float32).
    Raises:
        ValueError: shapes, dtypes or devices disagree, or ``out`` is not contiguous (nothing is
        written then).
    """
    B, T, D = x.shape
    C = weight.shape[1]
    if window.shape != (B, C - 1, D) or weight.shape != (D, C) or anc.shape != (B, T, C) or anc.dtype != torch.int64:
        raise ValueError(f"expected x [B, T, D], window [B, C-1, D], weight [D, C], anc int64 [B, T, C]; got "
                         f"{list(x.shape)}, {list(window.shape)}, {list(weight.shape)}, {anc.dtype} {list(anc.shape)}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"expected bias [D] = [{D}]; got {list(bias.shape)}")
    if len({t.device for t in (x, window, weight, anc, *([] if bias is None else [bias]))}) != 1:
        raise ValueError("all tensors must be on one device")
    if out is not None:
        check_out((out,), (B, T, D), (x.dtype,), x.device)
    # the kernel writes y densely, whatever x's layout (empty_like would keep a transposed x's strides)
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device) if out is None else out
    if y.numel() == 0:
        return y
    BT = 1 if B * T <= TUNING["node_programs"] else min(triton.next_power_of_2(T), TUNING["rows"])
    BD = min(triton.next_power_of_2(D), TUNING["BD"], max(16, TUNING["tile"] // BT))
    x = x if x.stride(-1) == 1 else x.contiguous()  # rows may be strided (a slice of a wider projection)
    _tree_conv_kernel[(B * triton.cdiv(T, BT), triton.cdiv(D, BD))](
        x, window.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else weight,
        anc.contiguous(), y, T, D, x.stride(0), x.stride(1), W=C - 1, C=C, BT=BT, BD=BD, HAS_BIAS=bias is not None,
    )
    return y


def conv_commit(x: Tensor, window: Tensor, path: Tensor, path_len: Tensor, out: Tensor | None = None) -> Tensor:
    """Conv window after committing an accepted path (Triton twin of
    ``specla.ops.conv.conv_window_after``).

    Args:
        x: ``[B, T, D]``; window: ``[B, C - 1, D]``; path: ``[B, P]`` int64 root-to-leaf, ``-1``
        padded; path_len: ``[B]`` int64 (``0``: the window is copied unchanged); out: optional
        ``[B, C - 1, D]`` contiguous, ``window`` itself included (the window is then updated in
        place: a recorded step's window stays its static buffer, with no copy back).
    Returns:
        ``[B, C - 1, D]``: the last ``C - 1`` inputs of ``[window ; x[path]]`` (``out`` when given).
    Raises:
        ValueError: shapes disagree, or ``out`` is not contiguous.
    """
    B, T, D = x.shape
    W = window.shape[1]
    if window.shape != (B, W, D) or path.dim() != 2 or path.shape[0] != B or path_len.shape != (B,):
        raise ValueError("expected x [B, T, D], window [B, W, D], path [B, P], path_len [B]")
    new = torch.empty(window.shape, dtype=window.dtype, device=window.device) if out is None else out
    if new.shape != window.shape or not new.is_contiguous():
        raise ValueError(f"expected out contiguous [B, W, D] = {list(window.shape)}; got {list(new.shape)}")
    if W == 0:
        return new
    BD = min(triton.next_power_of_2(D), 256)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if path.shape[1] == 0:  # no node to read (path_len is 0): the kernel still reads one entry
        path = torch.full((B, 1), -1, dtype=torch.int64, device=path.device)
    _conv_commit_kernel[(B, triton.cdiv(D, BD))](
        x, window.contiguous(), path.contiguous(), path_len.contiguous(), new, T,
        path.shape[1], D, x.stride(0), x.stride(1), W=W, WP=triton.next_power_of_2(W), BD=BD,
    )
    return new
