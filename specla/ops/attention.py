"""Softmax attention under a draft tree, over a fixed-capacity KV cache (docs/DESIGN.md section 3,
"Attention under a tree"): the operator an attention layer of a hybrid model verifies a tree with,
and the commit that writes the accepted path's keys and values into the cache. Sequential twin:
:func:`specla.ops.naive.naive_tree_attention`.

Shapes: ``B`` sequences, ``T`` tree nodes with the root explicit as node 0 (the last committed
token, whose keys and values are not yet in the cache), ``H`` query heads, ``HKV`` key/value heads
(``H`` a multiple of ``HKV``: grouped-query attention), ``Dh`` head dim, ``S`` cache capacity.
Positions: the cache holds positions ``0 .. len - 1``; node ``i`` sits at ``len + depth[i]``
(the root at ``len``), which is where the caller applies its rotary embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def tree_positions(cache_len: Tensor, depth: Tensor) -> Tensor:
    """Absolute positions of the tree nodes: ``cache_len[b] + depth[b, i]``.

    Args:
        cache_len: ``[B]`` int64 committed tokens in the cache. depth: ``[B, T]`` int64, ``0``
            for the root.
    Returns:
        ``[B, T]`` int64.
    """
    return cache_len[:, None] + depth


def tree_attention_mask(ancestors: Tensor, cache_len: Tensor, capacity: int, depth: Tensor,
                        window: int | None = None) -> Tensor:
    """Which keys each node attends to, over ``cat([cache, tree])``: the cache's first
    ``cache_len`` slots and the node's inclusive ancestors, never siblings; with a sliding
    ``window``, only keys at positions ``> position - window``.

    Args:
        ancestors: ``[B, T, T]`` bool inclusive-ancestor mask of the root-explicit tree
            (:func:`specla.tree.inclusive_ancestor_mask` of ``DraftTree.parents_with_root``).
        cache_len: ``[B]`` int64. capacity: ``S``. depth: ``[B, T]`` int64 (root 0).
        window: the sliding-window size in tokens (a key at distance ``>= window`` is masked),
            or ``None``.
    Returns:
        ``[B, T, S + T]`` bool, True where attention is allowed.
    """
    B, T, _ = ancestors.shape
    slots = torch.arange(capacity, device=cache_len.device)
    cache = (slots[None, None, :] < cache_len[:, None, None]).expand(B, T, capacity)
    if window is not None:
        pos = tree_positions(cache_len, depth)  # [B, T]
        cache = cache & (slots[None, None, :] > pos[:, :, None] - window)
        ancestors = ancestors & (depth[:, None, :] > depth[:, :, None] - window)  # ancestor depth vs own
    return torch.cat([cache, ancestors], -1)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_len: Tensor,
                   ancestors: Tensor, depth: Tensor, *, scale: float | None = None,
                   window: int | None = None) -> Tensor:
    """Every tree node's attention output as if its root path had been decoded one token at a
    time after the cached prefix: causal attention along each root path, all paths in one
    masked pass (SpecInfer's tree attention, Miao et al. 2024), through torch's
    ``scaled_dot_product_attention`` with a boolean mask and grouped-query heads.

    Args:
        q: ``[B, T, H, Dh]`` queries of the tree nodes (rotary embedding applied at
            :func:`tree_positions`). k, v: ``[B, T, HKV, Dh]`` their keys and values.
        k_cache, v_cache: ``[B, S, HKV, Dh]`` the cache (slots at or past ``cache_len`` are
            never read: any finite values may be there).
        cache_len: ``[B]`` int64 committed tokens in the cache.
        ancestors: ``[B, T, T]`` bool inclusive-ancestor mask (root-explicit tree).
        depth: ``[B, T]`` int64 node depths (root 0).
        scale: the softmax scale (``None``: ``Dh ** -0.5``). window: sliding window in tokens.
    Returns:
        ``[B, T, H, Dh]`` in ``q``'s dtype.
    Raises:
        ValueError: shapes disagree, or ``H`` is not a multiple of ``HKV``.
    """
    B, T, H, Dh = q.shape
    HKV = k.shape[2]
    if k.shape != (B, T, HKV, Dh) or v.shape != k.shape or H % HKV:
        raise ValueError(f"need q [B, T, H, Dh], k and v [B, T, HKV, Dh] with H a multiple of HKV; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.shape[0] != B or k_cache.shape[2:] != (HKV, Dh) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be [B={B}, S, HKV={HKV}, Dh={Dh}], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    mask = tree_attention_mask(ancestors, cache_len, k_cache.shape[1], depth, window)
    keys = torch.cat([k_cache, k.to(k_cache.dtype)], 1).transpose(1, 2)  # [B, HKV, S + T, Dh]
    values = torch.cat([v_cache, v.to(v_cache.dtype)], 1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2).to(keys.dtype), keys, values, attn_mask=mask[:, None],
                                         scale=scale, enable_gqa=H != HKV)
    return out.transpose(1, 2).to(q.dtype)


def commit_kv(k_cache: Tensor, v_cache: Tensor | None, cache_len: Tensor, k: Tensor, v: Tensor | None, path: Tensor,
              path_len: Tensor, *, capacity: int) -> Tensor:
    """Write the accepted path's keys and values (root first) into the cache at
    ``cache_len .. cache_len + path_len - 1``, in place, with fixed shapes and no host reads (a
    CUDA graph records it). Slots past ``cache_len + path_len`` and rows with ``path_len == 0``
    are left bit-identical: rejected nodes never reach the cache.

    A row whose cache is full stops growing: its length stays at ``capacity`` and what it would
    write past it lands in the spare slots ``capacity ..`` (a finished sequence kept in a CUDA
    graph's batch until the batch is gathered; its tokens are discarded anyway). The caller sizes
    ``capacity`` so that live sequences never get there.

    Args:
        k_cache, v_cache: ``[B, S, HKV, Dh]`` with ``S >= capacity + P``, written in place
            (``v_cache`` ``None``: a cache of keys only, whose values are the keys).
        cache_len: ``[B]`` int64 committed tokens before the commit (``<= capacity``).
        k, v: ``[B, T, HKV, Dh]`` the tree's keys and values (root-explicit; ``v`` ``None``
            with ``v_cache``).
        path: ``[B, P]`` int64 accepted node indices from the root (``-1`` padding).
        path_len: ``[B]`` int64 valid entries of ``path``.
        capacity: the tokens a row's cache holds.
    Returns:
        ``[B]`` int64, ``min(cache_len + path_len, capacity)``.
    Raises:
        ValueError: the cache has fewer than ``capacity + P`` slots.
    """
    B, S = k_cache.shape[:2]
    P = path.shape[1]
    if S < capacity + P:
        raise ValueError(f"the cache has {S} slots; a capacity of {capacity} and paths of {P} need {capacity + P}")
    offs = torch.arange(P, device=path.device)
    slot = cache_len.clamp(max=capacity)[:, None] + offs  # [B, P]: distinct, in bounds
    keep = offs[None, :] < path_len[:, None]
    node = path.clamp(min=0)
    for cache, new in ((k_cache, k), (v_cache, v))[: 1 if v_cache is None else 2]:
        index = slot[:, :, None, None].expand(B, P, *cache.shape[2:])
        fresh = new.gather(1, node[:, :, None, None].expand(B, P, *new.shape[2:])).to(cache.dtype)
        old = cache.gather(1, index)
        cache.scatter_(1, index, torch.where(keep[:, :, None, None], fresh, old))
    return (cache_len + path_len).clamp(max=capacity)


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
