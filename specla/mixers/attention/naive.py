"""Sequential twin of the tree attention (:mod:`specla.mixers.attention.reference`): each node,
head and key one at a time along the node's root path, in float64."""

from __future__ import annotations

import torch

from specla.ops.naive import root_path


def naive_tree_attention(q, k, v, k_cache, v_cache, cache_len, parents, *, scale=None, window=None):
    """Attention of each tree node over the cached prefix and its own root path, one node, head
    and key at a time in float64: the twin of :func:`specla.mixers.attention.reference.tree_attention`.

    Args:
        q: ``[B, T, H, Dh]``; k, v: ``[B, T, HKV, Dh]``; k_cache, v_cache: ``[B, S, HKV, Dh]``;
        cache_len: ``[B]`` int64; parents: ``[B, T]`` int64 root-explicit parents (the root,
        node 0, has ``-1``); scale: softmax scale (``None``: ``Dh ** -0.5``); window: sliding
        window in tokens or ``None``.
    Returns:
        ``[B, T, H, Dh]`` float64.
    """
    B, T, H, Dh = q.shape
    group = H // k.shape[2]
    scale = Dh**-0.5 if scale is None else scale
    out = torch.zeros(B, T, H, Dh, dtype=torch.float64)
    for b in range(B):
        n = int(cache_len[b])
        par = parents[b].tolist()
        for i in range(T):
            path = root_path(par, i)
            keys = [(p, k_cache[b, p], v_cache[b, p]) for p in range(n)] + \
                   [(n + d, k[b, j], v[b, j]) for d, j in enumerate(path)]
            pos = n + len(path) - 1
            keys = [kv for kv in keys if window is None or kv[0] > pos - window]
            for h in range(H):
                logits = torch.stack([q[b, i, h].double() @ kk[h // group].double() for _, kk, _ in keys])
                w = torch.softmax(logits * scale, 0)
                out[b, i, h] = sum(wj * vv[h // group].double() for wj, (_, _, vv) in zip(w, keys))
    return out
