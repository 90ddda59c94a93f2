"""Attention of a drafter's tree levels over the drafter's own key/value cache (the EAGLE and MTP
drafters, :mod:`specla.drafters`): each draft node attends to the cache and its own ancestors, and
the accepted pairs are appended to the cache. One-launch twins:
:mod:`specla.ops.attention_triton`. The target's attention layers verify with
:mod:`specla.mixers.attention`.

Shapes: ``B`` sequences, ``M`` draft nodes of one level, ``H`` query heads, ``HKV`` key/value heads
(``H`` a multiple of ``HKV``), ``Dh`` head dim, ``L`` the drafter cache's capacity.
"""

from __future__ import annotations

import torch
from torch import Tensor


def append_kv(cache_k: Tensor, cache_v: Tensor, cache_len: Tensor, k: Tensor, v: Tensor,
              num_accepted: Tensor) -> None:
    """Append a step's pairs to a drafter's key/value cache, in place, with fixed shapes (a CUDA
    graph records it): ``k[b, j]`` and ``v[b, j]`` go to slot ``min(cache_len[b] + j, L - 1)``
    for every ``j`` (pairs past the accepted ones land past the new length, where nothing reads
    them), then ``cache_len`` becomes ``min(cache_len + num_accepted + 1, L)``. A full row (a
    finished sequence kept in a graph's batch) writes its last slot, later ``j`` last. Twin of
    :func:`specla.ops.attention_triton.append_kv`.

    Args:
        cache_k, cache_v: ``[B, L, H, Dh]``; cache_len: ``[B]`` int64 ``<= L``; k, v: ``[B, W,
        H, Dh]`` in the cache's dtype; num_accepted: ``[B]`` int64 ``< W``.
    """
    B, W, L = k.shape[0], k.shape[1], cache_k.shape[1]
    rows = torch.arange(B, device=k.device)
    for j in range(W):  # pair by pair: one write per slot and row (a GPU's index_put picks any of duplicates)
        pos = (cache_len + j).clamp(max=L - 1)
        cache_k[rows, pos] = k[:, j]
        cache_v[rows, pos] = v[:, j]
    cache_len.copy_((cache_len + num_accepted + 1).clamp(max=L))


def draft_attention(q: Tensor, cache_k: Tensor, cache_v: Tensor, cache_len: Tensor, keys: Tensor,
                    values: Tensor) -> Tensor:
    """Attention of draft nodes over their sequence's cache and their own ancestors (the EAGLE
    drafter's level, :meth:`specla.drafters.eagle.EagleHead.step`): node ``(b, m)`` attends to
    ``cache[b, :cache_len[b]]`` and to ``keys[b, m]`` (its ancestors and itself), one softmax
    over both. Scores and softmax in at least float32; the cache is read in its own dtype, its
    products rounded to it (upcasting the cache would copy all of it every level). Its one-launch
    form is :func:`specla.ops.attention_triton.draft_level_attention`.

    Args:
        q: ``[B, M, H, Dh]``; cache_k, cache_v: ``[B, L, HKV, Dh]``; cache_len: ``[B]`` int64,
            ``0 <= cache_len <= L``; keys, values: ``[B, M, A, HKV, Dh]`` with ``A >= 1``;
            ``H`` a multiple of ``HKV`` (grouped-query heads: query head ``h`` reads key/value
            head ``h // (H / HKV)``).
    Returns:
        ``[B, M, H, Dh]`` in the promotion of ``q``'s dtype and float32.
    Source: EAGLE (Li et al. 2024) draft attention with EAGLE-2's tree ancestors.
    """
    B, M, H, Dh = q.shape
    HKV = cache_k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = (q.to(acc) * Dh**-0.5).view(B, M, HKV, H // HKV, Dh)  # [B, M, HKV, G, Dh]
    s_cache = torch.einsum("bmkgd,blkd->bmkgl", qf.to(cache_k.dtype), cache_k).to(acc)
    visible = torch.arange(cache_k.shape[1], device=q.device) < cache_len[:, None]  # [B, L]
    s_cache = s_cache.masked_fill(~visible[:, None, None, None, :], float("-inf"))
    s_anc = torch.einsum("bmkgd,bmakd->bmkga", qf, keys.to(acc))
    p = torch.softmax(torch.cat([s_cache, s_anc], -1), -1)  # never empty: the node itself is in
    L = cache_k.shape[1]
    out = torch.einsum("bmkgl,blkd->bmkgd", p[..., :L].to(cache_v.dtype), cache_v).to(acc)
    out = out + torch.einsum("bmkga,bmakd->bmkgd", p[..., L:], values.to(acc))
    return out.reshape(B, M, H, Dh)


def draft_level_attention(q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, cache_len: Tensor,
                          anc_k: Tensor, anc_v: Tensor, slot: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A draft level's attention from the previous level's state: node ``(b, m)`` hangs from
    row ``slot[b, m]`` of the previous level, whose keys and values (its ancestors and itself,
    ``A`` of them) it attends to, with its own key and the cache (:func:`draft_attention`); the
    node's ancestors and itself are what its own children attend to. Twin of
    :func:`specla.ops.attention_triton.draft_level_attention` (one launch, no gathers).

    Args:
        q: ``[B, M, H, Dh]``; k, v: ``[B, M, HKV, Dh]`` the nodes' own keys and values;
            cache_k, cache_v, cache_len: as :func:`draft_attention`; anc_k, anc_v: ``[B, P,
            A, HKV, Dh]``, ``A >= 0``; slot: ``[B, M]`` int64 below ``P``, or ``None`` (row ``m``:
            ``P == M``).
    Returns:
        ``(out [B, M, H, Dh]`` as :func:`draft_attention`, ``keys, values [B, M, A + 1, HKV,
        Dh])`` the ancestors' followed by the nodes' own.
    Source: EAGLE-2's tree drafting (Li et al. 2024): each node attends to its root path.
    """
    if slot is not None:
        index = slot.view(*slot.shape, 1, 1, 1).expand(-1, -1, *anc_k.shape[2:])
        anc_k, anc_v = anc_k.gather(1, index), anc_v.gather(1, index)
    keys, values = torch.cat([anc_k, k[:, :, None]], 2), torch.cat([anc_v, v[:, :, None]], 2)
    return draft_attention(q, cache_k, cache_v, cache_len, keys, values), keys, values
