"""Triton twins of :mod:`specla.ops.act`: one launch each where PyTorch takes two (SwiGLU: the
SiLU, then the product) or six (the gates: casts, add, softplus, products, sigmoid). Inside a CUDA
graph a decoding step is bound by the number of kernels it launches (BENCHMARKS.md section 5).
Same formulas and intermediate roundings, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gu, y, n, inter, srow, BLOCK: tl.constexpr):
    """Element ``i`` of ``[rows, inter]``: ``silu(g) * u``, ``g`` and ``u`` the two halves of the
    row (row stride ``srow``); the SiLU is rounded to the input dtype first, as in PyTorch."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row, col = i // inter, i % inter
    g = tl.load(gu + row * srow + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + row * srow + inter + col, mask=m, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(gu.dtype.element_ty).to(tl.float32)
    tl.store(y + i, (s * u).to(y.dtype.element_ty), mask=m)


@triton.jit
def softplus(x):
    """PyTorch's softplus of float32 ``x``: ``x`` above 20, else ``log1p(exp(x))`` to float32
    accuracy (in float64, where ``1 + e`` keeps ``e`` down to 1e-16, and ``e`` itself where it is
    below 1e-8: ``log1p(e) = e`` to 5e-9 relative); NaN stays NaN (``min(NaN, 20)`` is 20)."""
    xd = tl.minimum(x, 20.0).to(tl.float64)
    e = tl.exp(xd)
    sp = tl.where(x > 20.0, x, tl.where(xd < -18.5, e, tl.log(1.0 + e)).to(tl.float32))
    return tl.where(x != x, x, sp)


@triton.jit
def _gates_kernel(a, b, dt_bias, neg_A, g, beta, n, HV, sa, sb, beta_scale, BLOCK: tl.constexpr,
                  SCALE: tl.constexpr):
    """Element ``i`` of ``[rows, HV]``: ``g = neg_A * softplus(a + dt_bias)`` (PyTorch's
    softplus: ``x`` above 20, else ``log1p(exp(x))``), ``beta = sigmoid(b) * beta_scale``;
    ``a``/``b`` rows strided."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row, h = i // HV, i % HV
    x = tl.load(a + row * sa + h, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + h, mask=m, other=0.0)
    tl.store(g + i, tl.load(neg_A + h, mask=m, other=0.0) * softplus(x), mask=m)
    bt = tl.sigmoid(tl.load(b + row * sb + h, mask=m, other=0.0).to(tl.float32))
    if SCALE:
        bt = bt * beta_scale
    tl.store(beta + i, bt, mask=m)


def _row_view(x: Tensor) -> tuple[Tensor, int]:
    """``x [..., C]`` as ``[rows, C]`` with a dense last dim, without copying when the strides
    allow; returns it and its row stride."""
    try:
        v = x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims not collapsible into one stride
        v = x.reshape(-1, x.shape[-1])
    if v.stride(-1) != 1:
        v = v.contiguous()
    return v, v.stride(0)


def swiglu(gu: Tensor, inter: int, out: Tensor | None = None) -> Tensor:
    """SwiGLU of a stacked gate/up projection in one launch (twin: :func:`specla.ops.act.swiglu`).

    Args:
        gu: ``[..., 2 * inter]`` (rows may be strided; the last dim must be dense, else a copy).
        out: optional preallocated ``[..., inter]`` result in ``gu.dtype``, contiguous.
    Returns:
        ``[..., inter]`` contiguous, ``gu.dtype``.
    Raises:
        ValueError: ``gu``'s last dim is not ``2 * inter``, or ``out`` is not as described.
    """
    if gu.shape[-1] != 2 * inter:
        raise ValueError(f"gu has {gu.shape[-1]} channels, expected 2 * {inter}")
    rows, srow = _row_view(gu)
    shape = (*gu.shape[:-1], inter)
    if out is not None and (out.shape != shape or out.dtype != gu.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {gu.dtype} tensor of shape {list(shape)}")
    y = torch.empty(shape, dtype=gu.dtype, device=gu.device) if out is None else out
    n = rows.shape[0] * inter
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](rows, y, n, inter, srow, BLOCK=BLOCK)
    return y


def decay_and_sigmoid_gates(a: Tensor, b: Tensor, dt_bias: Tensor, neg_A: Tensor, beta_scale: float = 1.0,
                            out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Both gates of a gated delta rule in one launch (twin:
    :func:`specla.ops.act.decay_and_sigmoid_gates`, float32).

    Args:
        a, b: ``[..., HV]`` raw projections, same leading shape (rows may be strided: columns of
            a wider projection). dt_bias, neg_A: ``[HV]`` float32. beta_scale: 1 or 2.
        out: optional preallocated ``(g, beta)``, ``[..., HV]`` float32, contiguous.
    Returns:
        ``g, beta``: ``[..., HV]`` float32, contiguous (NaN inputs give NaN, as in PyTorch).
    Raises:
        ValueError: shapes disagree, ``dt_bias`` / ``neg_A`` are not float32, or ``out`` is
            not as described.
    """
    HV = a.shape[-1]
    if b.shape != a.shape or dt_bias.shape != (HV,) or neg_A.shape != (HV,):
        raise ValueError(f"expected a, b [..., {HV}] alike and dt_bias, neg_A [{HV}]; got {list(a.shape)}, "
                         f"{list(b.shape)}, {list(dt_bias.shape)}, {list(neg_A.shape)}")
    if dt_bias.dtype != torch.float32 or neg_A.dtype != torch.float32:
        raise ValueError(f"dt_bias and neg_A must be float32, got {dt_bias.dtype} and {neg_A.dtype}")
    a2, sa = _row_view(a)
    b2, sb = _row_view(b)
    if out is not None and any(o.shape != a.shape or o.dtype != torch.float32 or not o.is_contiguous() for o in out):
        raise ValueError(f"out must be two contiguous float32 tensors of shape {list(a.shape)}")
    g, beta = out if out is not None else (torch.empty(a.shape, dtype=torch.float32, device=a.device),
                                           torch.empty(a.shape, dtype=torch.float32, device=a.device))
    n = a2.shape[0] * HV
    if n:
        _gates_kernel[(triton.cdiv(n, BLOCK),)](a2, b2, dt_bias, neg_A, g, beta, n, HV, sa, sb, float(beta_scale),
                                                BLOCK=BLOCK, SCALE=beta_scale != 1.0)
    return g, beta
