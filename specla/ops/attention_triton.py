"""Triton twin of :func:`specla.ops.attention.draft_attention`: a draft level's attention in one
launch. The PyTorch form takes about twenty kernels per level (casts, four batched products, the
cache mask, concatenations, softmax), and the EAGLE drafter runs one level per tree depth inside
the recorded step, which is bound by the number of kernels it launches (BENCHMARKS.md section 4,
the step anatomy). One program per (node, head) walks the valid part of its cache in blocks and
then its ancestors with an online softmax (Milakov and Gimelshein 2018), in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _draft_attention_kernel(q, ck, cv, clen, ak, av, o, M, A, D, scale,
                            sqb, sqm, sqh, sckb, sckl, sckh, scvb, scvl, scvh,
                            sakb, sakm, saka, sakh, savb, savm, sava, savh, sob, som, soh,
                            BD: tl.constexpr, BL: tl.constexpr, BA: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b, m = i // M, i % M
    d = tl.arange(0, BD)
    dm = d < D
    qv = tl.load(q + b * sqb + m * sqm + h * sqh + d, mask=dm, other=0.0).to(tl.float32) * scale
    qc = qv.to(ck.dtype.element_ty).to(tl.float32)  # the cache's products take q in its dtype
    n = tl.load(clen + b)
    mx = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([BD], tl.float32)
    for start in range(0, n, BL):  # only the valid entries
        pos = start + tl.arange(0, BL)
        ok = pos < n
        kb = tl.load(ck + b * sckb + pos[:, None] * sckl + h * sckh + d[None, :], mask=ok[:, None] & dm[None, :],
                     other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(kb * qc[None, :], 1), float("-inf"))
        new = tl.maximum(mx, tl.max(s, 0))
        alpha = tl.exp(mx - new)
        p = tl.exp(s - new)
        vb = tl.load(cv + b * scvb + pos[:, None] * scvl + h * scvh + d[None, :], mask=ok[:, None] & dm[None, :],
                     other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vb, 0)
        den = den * alpha + tl.sum(p, 0)
        mx = new
    a = tl.arange(0, BA)
    oka = a < A
    kb = tl.load(ak + b * sakb + m * sakm + a[:, None] * saka + h * sakh + d[None, :],
                 mask=oka[:, None] & dm[None, :], other=0.0).to(tl.float32)
    s = tl.where(oka, tl.sum(kb * qv[None, :], 1), float("-inf"))
    new = tl.maximum(mx, tl.max(s, 0))
    alpha = tl.exp(mx - new)
    p = tl.exp(s - new)
    vb = tl.load(av + b * savb + m * savm + a[:, None] * sava + h * savh + d[None, :],
                 mask=oka[:, None] & dm[None, :], other=0.0).to(tl.float32)
    acc = acc * alpha + tl.sum(p[:, None] * vb, 0)
    den = den * alpha + tl.sum(p, 0)
    tl.store(o + b * sob + m * som + h * soh + d, (acc / den).to(o.dtype.element_ty), mask=dm)


def draft_attention(q: Tensor, cache_k: Tensor, cache_v: Tensor, cache_len: Tensor, keys: Tensor,
                    values: Tensor, out: Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """One launch of :func:`specla.ops.attention.draft_attention` (same arguments and result;
    float32 result; float64 inputs are not supported: use the PyTorch form).

    Args:
        q: ``[B, M, H, Dh]``; cache_k, cache_v: ``[B, L, H, Dh]``; cache_len: ``[B]`` int64;
            keys, values: ``[B, M, A, H, Dh]``, ``A >= 1``. Every last dim must be dense.
        out: optional ``[B, M, H, Dh]`` result; out_dtype: the result's dtype when ``out`` is
            not given (computed in float32, rounded once when stored).
    Returns:
        ``[B, M, H, Dh]`` (float32 by default).
    Raises:
        ValueError: shapes disagree, ``A < 1``, float64 inputs, or a last dim that is not dense.
    """
    B, M, H, Dh = q.shape
    L, A = cache_k.shape[1], keys.shape[2]
    if (cache_k.shape != (B, L, H, Dh) or cache_v.shape != cache_k.shape or keys.shape != (B, M, A, H, Dh)
            or values.shape != keys.shape or cache_len.shape != (B,) or A < 1):
        raise ValueError(f"draft_attention: q {list(q.shape)}, cache {list(cache_k.shape)}/{list(cache_v.shape)}, "
                         f"keys {list(keys.shape)}/{list(values.shape)}, cache_len {list(cache_len.shape)}: expected "
                         "[B, M, H, Dh], [B, L, H, Dh], [B, M, A >= 1, H, Dh] and [B]")
    if torch.float64 in (q.dtype, cache_k.dtype, keys.dtype):
        raise ValueError("draft_attention's kernel computes in float32; use specla.ops.attention.draft_attention "
                         "for float64")
    if any(x.stride(-1) != 1 for x in (q, cache_k, cache_v, keys, values)):
        raise ValueError("draft_attention: every input's last dim must be dense")
    if out is None:
        out = torch.empty(B, M, H, Dh, dtype=out_dtype, device=q.device)
    if B * M:
        _draft_attention_kernel[(B * M, H)](
            q, cache_k, cache_v, cache_len, keys, values, out, M, A, Dh, Dh ** -0.5,
            q.stride(0), q.stride(1), q.stride(2), *cache_k.stride()[:3], *cache_v.stride()[:3],
            *keys.stride()[:4], *values.stride()[:4], out.stride(0), out.stride(1), out.stride(2),
            BD=triton.next_power_of_2(Dh), BL=64, BA=triton.next_power_of_2(A))
    return out
