"""Triton twin of :func:`specla.ops.attention.draft_level_attention`: a draft level's attention
(:func:`~specla.ops.attention.draft_attention` with the parents' rows) in one launch. The
PyTorch forms take about twenty kernels per level (casts, four batched products, the cache mask,
concatenations, gathers, softmax), and the EAGLE drafter runs one level per tree depth inside the
recorded step, which is bound by the number of kernels it launches (BENCHMARKS.md section 4, the
step anatomy). One program per (node, head) walks the valid part of its cache in blocks and then
its ancestors (read through the parent's row) and itself with an online softmax (Milakov and
Gimelshein 2018), in float32, and writes the keys and values its children attend to. Twin of
:func:`specla.ops.attention.append_kv` too: the accepted pairs into the drafter's cache and its
new length in one launch (seven in PyTorch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import check_out


@triton.jit
def _draft_attention_kernel(q, ck, cv, clen, ak, av, slot, sk, sv, o, nk, nv, M, A, D, G, scale,
                            sqb, sqm, sqh, sckb, sckl, sckh, scvb, scvl, scvh,
                            sakb, sakm, saka, sakh, savb, savm, sava, savh,
                            sskb, sskm, sskh, ssvb, ssvm, ssvh, sob, som, soh,
                            BD: tl.constexpr, BL: tl.constexpr, BA: tl.constexpr,
                            HAS_SLOT: tl.constexpr):
    """Node ``(b, m)``, query head ``h`` (key/value head ``h // G``): the cache's valid entries,
    then the ``A`` ancestors of row ``slot[b, m]`` (``m`` without ``HAS_SLOT``) of ``ak``/``av``,
    then the node's own key ``sk[b, m]``; the first query head of each group also stores those
    ``A + 1`` keys and values as the node's row of ``nk``/``nv`` (contiguous ``[B, M, A + 1,
    HKV, D]``), what its children attend to."""
    i = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    HKV = tl.num_programs(1) // G
    h = hq // G  # the key/value head: every load below but q's reads it
    b, m = i // M, i % M
    d = tl.arange(0, BD)
    dm = d < D
    qv = tl.load(q + b * sqb + m * sqm + hq * sqh + d, mask=dm, other=0.0).to(tl.float32) * scale
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
    if HAS_SLOT:
        r = tl.load(slot + b * M + m)  # the parent's row of the previous level
    else:
        r = m
    a = tl.arange(0, BA)
    anc = (a < A)[:, None] & dm[None, :]
    me = (a == A)[:, None]
    kb = tl.load(ak + b * sakb + r * sakm + a[:, None] * saka + h * sakh + d[None, :], mask=anc, other=0.0)
    ks = tl.load(sk + b * sskb + m * sskm + h * sskh + d, mask=dm, other=0.0)
    kb = tl.where(me, ks[None, :], kb).to(tl.float32)
    vb = tl.load(av + b * savb + r * savm + a[:, None] * sava + h * savh + d[None, :], mask=anc, other=0.0)
    vs = tl.load(sv + b * ssvb + m * ssvm + h * ssvh + d, mask=dm, other=0.0)
    vb = tl.where(me, vs[None, :], vb).to(tl.float32)
    s = tl.where(a <= A, tl.sum(kb * qv[None, :], 1), float("-inf"))
    new = tl.maximum(mx, tl.max(s, 0))
    alpha = tl.exp(mx - new)
    p = tl.exp(s - new)
    acc = acc * alpha + tl.sum(p[:, None] * vb, 0)
    den = den * alpha + tl.sum(p, 0)
    tl.store(o + b * sob + m * som + hq * soh + d, (acc / den).to(o.dtype.element_ty), mask=dm)
    if hq % G == 0:  # one writer per key/value head
        row = ((i * (A + 1) + a[:, None]) * HKV + h) * D + d[None, :]
        ok = (a <= A)[:, None] & dm[None, :]
        tl.store(nk + row, kb.to(nk.dtype.element_ty), mask=ok)
        tl.store(nv + row, vb.to(nv.dtype.element_ty), mask=ok)


def draft_level_attention(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, cache_len: Tensor,
                          anc_k: Tensor, anc_v: Tensor, slot: Tensor | None = None,
                          out_dtype: torch.dtype = torch.float32,
                          out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One launch of :func:`specla.ops.attention.draft_level_attention` (same arguments and
    results): the parents' ancestors are read through ``slot`` and the children's keys and
    values written by the same program, so a draft level gathers and concatenates nothing.

    Args:
        q: ``[B, M, H, Dh]``; k, v: ``[B, M, HKV, Dh]`` (strided views of a fused projection
            are fine), ``H`` a multiple of ``HKV`` (grouped-query heads: query head ``h`` reads
            key/value head ``h // (H / HKV)``); cache_k, cache_v: ``[B, L, HKV, Dh]``;
            cache_len: ``[B]`` int64; anc_k, anc_v: ``[B, P, A, HKV, Dh]``, ``A >= 0``; slot:
            ``[B, M]`` int64 rows of ``anc_*`` below ``P`` (not checked: a host read), or
            ``None`` (``P == M``). Every last dim dense.
        out_dtype: the output's dtype (computed in float32, rounded once when stored).
        out: optional preallocated results (contiguous, the shapes and dtypes returned).
    Returns:
        ``(out [B, M, H, Dh]`` in ``out_dtype``, ``keys, values [B, M, A + 1, HKV, Dh])`` in
        ``k``'s and ``v``'s dtypes.
    Raises:
        ValueError: shapes disagree, float64 inputs, a last dim that is not dense, or ``out``
            of another layout.
    """
    B, M, H, Dh = q.shape
    L, (P, A), HKV = cache_k.shape[1], anc_k.shape[1:3], k.shape[2]
    if (k.shape != (B, M, HKV, Dh) or v.shape != k.shape or HKV < 1 or H % HKV
            or cache_k.shape != (B, L, HKV, Dh) or cache_v.shape != cache_k.shape
            or anc_k.shape != (B, P, A, HKV, Dh) or anc_v.shape != anc_k.shape or cache_len.shape != (B,)
            or (slot is None and P != M) or (slot is not None and (slot.shape != (B, M) or slot.dtype != torch.int64))):
        raise ValueError(f"draft_level_attention: q/k/v {list(q.shape)}/{list(k.shape)}/{list(v.shape)}, cache "
                         f"{list(cache_k.shape)}/{list(cache_v.shape)}, ancestors {list(anc_k.shape)}/"
                         f"{list(anc_v.shape)}, cache_len {list(cache_len.shape)}, slot "
                         f"{None if slot is None else (list(slot.shape), slot.dtype)}: expected q [B, M, H, Dh], "
                         "k/v [B, M, HKV, Dh] with HKV dividing H, [B, L, HKV, Dh], [B, P, A, HKV, Dh], [B] and "
                         "int64 [B, M] (or None with P == M)")
    if torch.float64 in (q.dtype, k.dtype, v.dtype, cache_k.dtype, anc_k.dtype):
        raise ValueError("draft_level_attention's kernel computes in float32; use "
                         "specla.ops.attention.draft_level_attention for float64")
    if any(x.stride(-1) != 1 for x in (q, k, v, cache_k, cache_v, anc_k, anc_v)):
        raise ValueError("draft_level_attention: every input's last dim must be dense")
    if out is None:
        out = (torch.empty(B, M, H, Dh, dtype=out_dtype, device=q.device),
               torch.empty(B, M, A + 1, HKV, Dh, dtype=k.dtype, device=q.device),
               torch.empty(B, M, A + 1, HKV, Dh, dtype=v.dtype, device=q.device))
    check_out(out[:1], (B, M, H, Dh), (out[0].dtype,), q.device)
    check_out(out[1:], (B, M, A + 1, HKV, Dh), (k.dtype, v.dtype), q.device)
    out, keys, values = out
    if B * M:  # cache_len and slot are read densely
        _draft_attention_kernel[(B * M, H)](
            q, cache_k, cache_v, cache_len.contiguous(), anc_k, anc_v,
            cache_len if slot is None else slot.contiguous(), k, v, out, keys, values, M, A, Dh, H // HKV, Dh ** -0.5,
            q.stride(0), q.stride(1), q.stride(2), *cache_k.stride()[:3], *cache_v.stride()[:3],
            *anc_k.stride()[:4], *anc_v.stride()[:4], *k.stride()[:3], *v.stride()[:3],
            out.stride(0), out.stride(1), out.stride(2),
            BD=triton.next_power_of_2(Dh), BL=64, BA=triton.next_power_of_2(A + 1), HAS_SLOT=slot is not None)
    return out, keys, values


@triton.jit
def _append_kv_kernel(ck, cv, clen, k, v, num_acc, L, W, E, skb, skw, svb, svw, BE: tl.constexpr):
    """Program ``b``: the row's ``W`` pairs in order (a full row's last pair lands last), then
    its new length. ``E`` elements per pair (heads times head dim), dense within a pair; pair
    ``(b, j)`` of ``k`` starts at ``b * skb + j * skw`` (``v`` likewise), the caches dense."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(clen + b)
    for j in range(0, W):
        pos = tl.minimum(n + j, L - 1)
        for start in range(0, E, BE):
            c = start + tl.arange(0, BE)
            ok = c < E
            tl.store(ck + (b * L + pos) * E + c, tl.load(k + b * skb + j * skw + c, mask=ok), mask=ok)
            tl.store(cv + (b * L + pos) * E + c, tl.load(v + b * svb + j * svw + c, mask=ok), mask=ok)
    tl.store(clen + b, tl.minimum(n + tl.load(num_acc + b) + 1, L))


def append_kv(cache_k: Tensor, cache_v: Tensor, cache_len: Tensor, k: Tensor, v: Tensor,
              num_accepted: Tensor) -> None:
    """:func:`specla.ops.attention.append_kv` in one launch (same arguments, in place). ``k`` and
    ``v`` may be strided views (the chunks of a fused key/value projection: no copy) as long as
    each pair's ``heads x head dim`` elements are dense; others are copied first.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, or a cache, ``cache_len`` or
            ``num_accepted`` that is not contiguous (written or read in place).
    """
    B, L, H, Dh = cache_k.shape
    W = k.shape[1] if k.dim() == 4 else -1
    if (cache_v.shape != cache_k.shape or k.shape != (B, W, H, Dh) or v.shape != k.shape
            or cache_len.shape != (B,) or num_accepted.shape != (B,)
            or {cache_k.dtype, cache_v.dtype, k.dtype, v.dtype} != {cache_k.dtype}
            or cache_len.dtype != torch.int64 or num_accepted.dtype != torch.int64
            or len({x.device for x in (cache_k, cache_v, cache_len, k, v, num_accepted)}) != 1
            or not all(x.is_contiguous() for x in (cache_k, cache_v, cache_len, num_accepted))):
        raise ValueError(f"append_kv: caches {list(cache_k.shape)}/{list(cache_v.shape)}, k/v {list(k.shape)}/"
                         f"{list(v.shape)}, cache_len {list(cache_len.shape)} {cache_len.dtype}, num_accepted "
                         f"{list(num_accepted.shape)} {num_accepted.dtype}: expected contiguous [B, L, H, Dh] "
                         "caches, [B, W, H, Dh] pairs of their dtype, contiguous int64 [B] lengths and counts, "
                         "one device")
    if B and W:
        k, v = (x if x.stride(3) == 1 and x.stride(2) == Dh else x.contiguous() for x in (k, v))
        _append_kv_kernel[(B,)](cache_k, cache_v, cache_len, k, v, num_accepted, L, W, H * Dh, k.stride(0),
                                k.stride(1), v.stride(0), v.stride(1), BE=min(triton.next_power_of_2(H * Dh), 1024))
