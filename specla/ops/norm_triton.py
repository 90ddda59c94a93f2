"""Triton twins of :mod:`specla.ops.norm`: one launch where the PyTorch forms take five to eight
(cast, square, mean, add, rsqrt, products, cast back). Inside a CUDA graph a step is bound by
the number of kernels it launches (BENCHMARKS.md section 5), and a GDN layer runs three RMSNorms
and two L2 norms. Same formulas, same intermediate roundings, computed in float32 (float64 for
float64 inputs) as FLA does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .norm import compute_dtype


# R (rows per group) follows the prompt length in a drafter's reset: not specialised on (Triton
# specialises integers on == 1 and % 16), so a new length never compiles a kernel inside a call
@triton.jit(do_not_specialize=["R"])
def _rms_norm_kernel(x, w, g, y, D, R, sxo, sxi, sgo, sgi, eps, BD: tl.constexpr, F64: tl.constexpr,
                     GATE: tl.constexpr, SIGMOID: tl.constexpr, OFFSET: tl.constexpr):
    """One row: ``t = x * rsqrt(mean(x^2) + eps) * w`` (``* (1 + w)`` with ``OFFSET``) rounded to
    x's dtype; with ``GATE``,
    ``y = t * act(g)`` (act: SiLU, or sigmoid), stored in y's dtype. Row ``i`` is row ``i % R``
    of group ``i // R`` (strides ``s?i`` and ``s?o``): heads of a token inside a wider projection."""
    i = tl.program_id(0).to(tl.int64)
    io, ii = i // R, i % R
    ct = tl.float64 if F64 else tl.float32
    o = tl.arange(0, BD)
    m = o < D
    xr = tl.load(x + io * sxo + ii * sxi + o, mask=m, other=0.0).to(ct)
    r = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / D + eps)
    wr = tl.load(w + o, mask=m, other=0.0).to(ct)
    if OFFSET:
        wr = wr + 1.0
    t = xr * r * wr
    if GATE:
        t = t.to(x.dtype.element_ty).to(ct)  # the PyTorch form rounds the norm to x's dtype first
        gr = tl.load(g + io * sgo + ii * sgi + o, mask=m, other=0.0).to(ct)
        t = t * (tl.sigmoid(gr) if SIGMOID else gr * tl.sigmoid(gr))
    tl.store(y + i * D + o, t.to(y.dtype.element_ty), mask=m)


@triton.jit
def _l2norm_pair_kernel(x, qo, ko, H, K, st, eps, BK: tl.constexpr, F64: tl.constexpr):
    """Row (token, head) of the ``[q heads ; k heads]`` block: ``x * rsqrt(sum(x^2) + eps)``."""
    r = tl.program_id(0).to(tl.int64)
    tok, head = r // (2 * H), r % (2 * H)
    ct = tl.float64 if F64 else tl.float32
    o = tl.arange(0, BK)
    m = o < K
    xr = tl.load(x + tok * st + head * K + o, mask=m, other=0.0).to(ct)
    yr = xr * (1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) + eps))
    if head < H:
        tl.store(qo + (tok * H + head) * K + o, yr.to(qo.dtype.element_ty), mask=m)
    else:
        tl.store(ko + (tok * H + head - H) * K + o, yr.to(ko.dtype.element_ty), mask=m)


def _rows(x: Tensor) -> tuple[Tensor, int, int, int]:
    """``x`` (``[..., R, D]``) as groups of ``R`` rows with a dense last dim, without copying
    when the strides allow: (tensor ``[G, R, D]``, R, group stride, row stride)."""
    R = x.shape[-2] if x.dim() > 1 else 1
    try:
        v = x.view(-1, R, x.shape[-1])
    except RuntimeError:  # leading dims not collapsible into one stride
        v = x.reshape(-1, R, x.shape[-1]).contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    return v, R, v.stride(0), v.stride(1)


def rms_norm(x: Tensor, weight: Tensor, eps: float, gate: Tensor | None = None, activation: str = "swish",
             out_dtype: torch.dtype | None = None, out: Tensor | None = None, unit_offset: bool = False) -> Tensor:
    """RMSNorm over the last dimension in one launch; with ``gate``, the gated form of FLA's
    ``FusedRMSNormGated`` (``norm(x) * act(gate)``). Twin: :func:`specla.ops.norm.rms_norm` and
    :func:`specla.ops.norm.gated_rms_norm`.

    Args:
        x: ``[..., D]`` any float dtype; rows may be strided (the last dim must be dense, else
            a copy is made). weight: ``[D]``. eps: added to the mean square.
        gate: optional ``[..., D]`` like ``x``. activation: ``swish``/``silu`` or ``sigmoid``.
        out_dtype: dtype of the result (default: ``x.dtype`` without a gate, the compute dtype
            with one, as the PyTorch form). out: optional preallocated result.
        unit_offset: scale by ``1 + weight`` (the zero-centred RMSNorm of Qwen3.5 and
            Qwen3-Next, whose weights are stored around 0), computed in the compute dtype.
    Returns:
        ``[..., D]`` contiguous.
    Raises:
        ValueError: shapes or devices disagree, or an unknown activation.
    """
    D = x.shape[-1]
    if weight.shape != (D,) or (gate is not None and gate.shape != x.shape):
        raise ValueError(f"expected weight [{D}] and gate like x {list(x.shape)}; got {list(weight.shape)}, "
                         f"{None if gate is None else list(gate.shape)}")
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"activation must be swish, silu or sigmoid, got {activation!r}")
    ct = compute_dtype(x)
    if out_dtype is None:
        out_dtype = x.dtype if gate is None else ct
    x3, R, sxo, sxi = _rows(x)
    g3, _, sgo, sgi = _rows(gate) if gate is not None else (x3, R, sxo, sxi)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    if x3.numel():
        _rms_norm_kernel[(x3.shape[0] * R,)](x3, weight, g3, y, D, R, sxo, sxi, sgo, sgi, eps,
                                             BD=triton.next_power_of_2(D), F64=ct == torch.float64, GATE=gate is not None,
                                             SIGMOID=activation == "sigmoid", OFFSET=unit_offset)
    return y


def l2norm_pair(x: Tensor, H: int, K: int, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """L2-normalised q and k heads of a ``[q ; k ; ...]`` projection in one launch (twin:
    :func:`specla.ops.norm.l2norm` applied to each).

    Args:
        x: ``[B, T, D]`` with ``D >= 2 H K``; the first ``H K`` channels are q's ``H`` heads of
            ``K``, the next ``H K`` k's (the rest is ignored); the last dim must be dense.
        H, K: heads and head dim; eps: added to the sum of squares.
    Returns:
        ``q, k``: ``[B, T, H, K]`` contiguous, in the compute dtype (float32, or float64).
    Raises:
        ValueError: ``D < 2 H K``.
    """
    B, T, D = x.shape
    if D < 2 * H * K:
        raise ValueError(f"x has {D} channels, fewer than q and k's 2 * {H} * {K}")
    if x.stride(-1) != 1 or x.stride(0) != T * x.stride(1):
        x = x.contiguous()
    ct = compute_dtype(x)
    q = torch.empty(B, T, H, K, dtype=ct, device=x.device)
    k = torch.empty_like(q)
    if B * T:
        _l2norm_pair_kernel[(B * T * 2 * H,)](x, q, k, H, K, x.stride(1), eps, BK=triton.next_power_of_2(K),
                                              F64=ct == torch.float64)
    return q, k
