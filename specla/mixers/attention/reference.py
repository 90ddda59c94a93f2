"""Softmax attention under a draft tree, over a fixed-capacity KV cache (docs/DESIGN.md section 3,
"Attention under a tree"): the operator an attention layer of a hybrid model verifies a tree with,
and the commit that writes the accepted path's keys and values into the cache. Sequential twin:
:func:`specla.mixers.attention.naive.naive_tree_attention`.

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
