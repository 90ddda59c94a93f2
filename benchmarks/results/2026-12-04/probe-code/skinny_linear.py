"""A linear layer for few rows (``M <= 16``: a decoding step's tokens at small batch), with the
step's glue fused in: RMSNorm or SwiGLU of the input, and the residual add of the output.

At one token a linear layer reads its whole weight for a handful of products, so its time is the
weight's bytes over the memory bandwidth. cuBLAS reaches about 60 % of the H200's bandwidth on the
GEMMs of a GDN-1.3B step at batch 1 (BENCHMARKS.md section 5, "Where specla's AR step goes"), and
each RMSNorm and SwiGLU before a GEMM is one more launch of a step bound by its launches. Here each
program owns ``BN`` output columns for every row, streams its ``[BN, K]`` slice of the weight once,
and recomputes the cheap input transform from the ``M x K`` input that every program shares (it stays
in L2). Twin: :func:`skinny_linear_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specla.ops.act import swiglu as swiglu_reference
from specla.ops.norm import rms_norm as rms_norm_reference

MAX_ROWS = 16
# (BN, BK, num_warps, num_stages) by the input transform; chosen on one H200 by
# skinny_linear_sweep.py (beside this file) at the GDN-1.3B shapes
TUNING = {"plain": (16, 256, 4, 4), "norm": (32, 512, 4, 3), "swiglu": (16, 512, 4, 4), "pdl": False}


@triton.jit
def _skinny_linear_kernel(x, w, y, res, nw, M, N, K, sx, sy, sr, inter, eps, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr,
                          STAGES: tl.constexpr, PDL: tl.constexpr):
    """Columns ``[pid BN, pid BN + BN)`` of ``y [M, N] = f(x) @ w.T (+ res)``, accumulated in
    float32 and rounded once. ``f``: identity; RMSNorm with weight ``nw`` (``NORM``: the row's
    inverse RMS first, then ``x * r * nw`` rounded to x's dtype, the formula of
    :func:`specla.ops.norm_triton.rms_norm`); SwiGLU of the halves ``x[:, :inter]``, ``x[:, inter:]``
    (``SWIGLU``: the SiLU rounded to x's dtype, then the product rounded, as
    :func:`specla.ops.act_triton.swiglu`). ``BM == 1`` multiplies on the CUDA cores, else ``tl.dot``
    on rows padded to ``BM``."""
    pid = tl.program_id(0).to(tl.int64)
    rn = pid * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, BM)
    mm = rm < M
    dt = x.dtype.element_ty
    if PDL:  # let the next launch start now; read nothing the previous kernel writes before its end
        tl.extra.cuda.gdc_launch_dependents()
        wpre = tl.load(w + rn[:, None] * K + tl.arange(0, BK)[None, :], mask=nm[:, None] & (tl.arange(0, BK) < K)[None, :],
                       other=0.0)
        tl.extra.cuda.gdc_wait()
    if NORM:  # the row's 1 / RMS over all K columns
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            xv = tl.load(x + rm[:, None] * sx + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0)
            xv = xv.to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        rs = 1.0 / tl.sqrt(ss / K + eps)
    if BM == 1:
        acc = tl.zeros([BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        xm = mm[:, None] & km[None, :]
        xp = x + rm[:, None] * sx + rk[None, :]
        if SWIGLU:
            g = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            u = tl.load(xp + inter, mask=xm, other=0.0).to(tl.float32)
            a = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt)
        elif NORM:
            xv = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            wn = tl.load(nw + rk, mask=km, other=0.0).to(tl.float32)
            a = (xv * rs[:, None] * wn[None, :]).to(dt)
        else:
            a = tl.load(xp, mask=xm, other=0.0)
        if PDL and k0 == 0:
            wt = wpre
        else:
            wt = tl.load(w + rn[:, None] * K + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if BM == 1:
            acc += tl.sum(wt.to(tl.float32) * tl.reshape(a, [BK]).to(tl.float32)[None, :], axis=1)
        else:
            acc = tl.dot(a, tl.trans(wt), acc)
    if BM == 1:
        out = acc[None, :]
    else:
        out = acc
    om = mm[:, None] & nm[None, :]
    if RES:
        out += tl.load(res + rm[:, None] * sr + rn[None, :], mask=om, other=0.0).to(tl.float32)
    tl.store(y + rm[:, None] * sy + rn[None, :], out.to(y.dtype.element_ty), mask=om)


def _check(x: Tensor, weight: Tensor, norm: tuple[Tensor, float] | None, swiglu: bool,
           residual: Tensor | None) -> int:
    """The input width the weight multiplies; raises ``ValueError`` naming what disagrees."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    if norm is not None and swiglu:
        raise ValueError("norm and swiglu cannot both transform the input")
    K = x.shape[1] // 2 if swiglu else x.shape[1]
    if swiglu and x.shape[1] % 2:
        raise ValueError(f"swiglu needs an even input width, got {x.shape[1]}")
    if weight.shape[1] != K:
        what = f"SwiGLU's output of width {K} (x has {x.shape[1]} columns)" if swiglu else f"an input of width {K}"
        raise ValueError(f"weight {list(weight.shape)} does not multiply {what}")
    if norm is not None and norm[0].shape != (K,):
        raise ValueError(f"norm weight must be [{K}], got {list(norm[0].shape)}")
    if residual is not None and residual.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"residual must be [{x.shape[0]}, {weight.shape[0]}], got {list(residual.shape)}")
    return K


def skinny_linear(x: Tensor, weight: Tensor, *, norm: tuple[Tensor, float] | None = None, swiglu: bool = False,
                  residual: Tensor | None = None) -> Tensor:
    """``f(x) @ weight.T``, plus ``residual`` in place when given, in one launch for ``M <= 16``
    rows (twin: :func:`skinny_linear_reference`; each output element is accumulated in float32
    and rounded once, as cuBLAS's ``addmm`` with ``beta = 1``).

    Args:
        x: ``[M, Kx]`` float16 or bfloat16, ``1 <= M <= 16``, last dim dense.
        weight: ``[N, K]`` in x's dtype, contiguous (``nn.Linear``'s layout).
        norm: ``(w [K], eps)``: ``f`` is RMSNorm (:func:`specla.ops.norm.rms_norm`; float32
            compute, rounded to x's dtype), ``Kx = K``.
        swiglu: ``f`` is SwiGLU of the stacked gate/up halves (:func:`specla.ops.act.swiglu`),
            ``Kx = 2 K``. Otherwise ``f`` is the identity, ``Kx = K``.
        residual: ``[M, N]`` in x's dtype with a dense last dim, sharing no memory with x (the
            programs write it while others read x): the result is added to it and
            written into it (it is returned).
    Returns:
        ``[M, N]`` in x's dtype (``residual`` itself when given, else a new contiguous tensor).
    Raises:
        ValueError: shapes, dtypes or devices disagree, ``M`` is outside ``[1, 16]``, both
            ``norm`` and ``swiglu`` are given, or ``residual`` shares memory with x or
            between its rows.
    """
    K = _check(x, weight, norm, swiglu, residual)
    M, N = x.shape[0], weight.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {MAX_ROWS} rows, got {M}")
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share float16 or bfloat16, got {x.dtype} and {weight.dtype}")
    if residual is not None and (residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must be {x.dtype} with a dense last dim, got {residual.dtype}, "
                         f"strides {residual.stride()}")
    if residual is not None and (residual.stride(0) < residual.shape[1] and residual.shape[0] > 1
                                 or residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()):
        raise ValueError("residual must have its own rows and share no memory with x")
    devices = {x.device, weight.device} | {t.device for t in (residual, norm[0] if norm else None) if t is not None}
    if len(devices) != 1:
        raise ValueError("x, weight, norm weight and residual must be on one device")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    BN, BK, warps, stages = TUNING["swiglu" if swiglu else "norm" if norm is not None else "plain"]
    BK = min(BK, max(16, triton.next_power_of_2(K)))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if residual is None else residual
    nw, eps = (norm[0].contiguous(), norm[1]) if norm is not None else (weight, 0.0)
    res = residual if residual is not None else y
    _skinny_linear_kernel[(triton.cdiv(N, BN),)](
        x, weight, y, res, nw, M, N, K, x.stride(0), y.stride(0), res.stride(0), K, float(eps),
        BM=1 if M == 1 else MAX_ROWS, BN=BN, BK=BK, NORM=norm is not None, SWIGLU=swiglu, RES=residual is not None,
        STAGES=stages, PDL=TUNING["pdl"], num_warps=warps, **({"launch_pdl": True} if TUNING["pdl"] else {}))
    return y


def skinny_linear_reference(x: Tensor, weight: Tensor, *, norm: tuple[Tensor, float] | None = None,
                            swiglu: bool = False, residual: Tensor | None = None) -> Tensor:
    """PyTorch twin of :func:`skinny_linear` (same arguments and result, any float dtype, any
    ``M``): the input transform of :mod:`specla.ops.norm` or :mod:`specla.ops.act`, then the
    product accumulated in float32 (float64 for float64) and rounded once after the residual.

    Raises:
        ValueError: as :func:`skinny_linear` for shapes.
    """
    K = _check(x, weight, norm, swiglu, residual)
    if norm is not None:
        x = rms_norm_reference(x, norm[0], norm[1])
    elif swiglu:
        x = swiglu_reference(x, K)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = x.to(ct) @ weight.to(ct).T
    if residual is None:
        return out.to(x.dtype)
    residual.copy_(out + residual.to(ct))
    return residual
