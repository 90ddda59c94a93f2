"""The softmax-attention mixer every hybrid shares: a KV cache of fixed capacity verified over a
draft tree (:mod:`specla.mixers.attention.reference`); a plugin supplies its projections.

Shapes: ``B`` sequences, ``T`` verified nodes with the root explicit (node 0), ``H`` query heads,
``HKV`` key/value heads, ``Dh`` head dim, ``hidden`` model width.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from specla.errors import SpecError
from specla.mixers.base import PREFILL_CHUNK, Mixer, TreePass
from specla.records import LayerCommit, Record

from .records import KVRecord
from .reference import commit_kv, tree_attention


class AttentionMixer(Mixer):
    """Softmax attention over a KV cache of fixed capacity, verified over a draft tree
    (:func:`specla.mixers.attention.reference.tree_attention`: each node sees the committed cache and its own
    ancestors) and committed by writing the accepted path's keys and values
    (:func:`specla.mixers.attention.reference.commit_kv`; rejected nodes never reach the cache). Lengths live on
    the device, so a step records in a CUDA graph.

    A plugin subclasses it with the model's projections: :meth:`project` (queries, keys, values
    at given positions, rotary embedding applied, and an optional output gate) and
    :meth:`output`. State: ``k_cache, v_cache [B, capacity + PREFILL_CHUNK + 1, HKV, Dh]`` (the
    spare slots absorb what a finished row kept in a graph's batch would write past a full cache)
    and ``cache_len [B]`` int64.

    Args:
        num_kv_heads, head_dim: ``HKV`` and ``Dh``.
        dtype, device: the cache's.
        scale: softmax scale (``None``: ``Dh ** -0.5``). window: sliding window in tokens, or
            ``None``.
    """

    recurrent = False
    baselines = frozenset({"snapshot", "replay"})  # the KV record's commit is every strategy's
    shared_kv = False
    """Whether the values are the keys themselves (multi-head latent attention in its absorbed
    form, where :meth:`output` reads the part of the attention output it needs): one cache
    serves both, ``v_cache`` is ``k_cache`` and the state holds it once."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
                 scale: float | None = None, window: int | None = None):
        self.HKV, self.Dh, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.scale, self.window = scale, window
        self.empty_state(0, 0)

    @abstractmethod
    def project(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``q [B, T, H, Dh]``, ``k, v [B, T, HKV, Dh]`` (rotary embedding at ``positions [B,
        T]`` int64 applied) and the output gate's input (or ``None``) from ``h [B, T, hidden]``."""

    @abstractmethod
    def output(self, o: Tensor, gate: Tensor | None) -> Tensor:
        """The mixer's output ``[B, T, hidden]`` from the attention output ``o [B, T, H, Dh]``."""

    def empty_state(self, B: int, capacity: int) -> None:
        self.capacity = capacity
        slots = capacity + PREFILL_CHUNK + 1  # the widest path a commit writes: a prefill chunk
        self.k_cache = torch.zeros(B, slots, self.HKV, self.Dh, dtype=self.dtype, device=self.device)
        self.v_cache = self.k_cache if self.shared_kv else torch.zeros_like(self.k_cache)
        self.cache_len = torch.zeros(B, dtype=torch.int64, device=self.device)

    def cache_bytes(self, B: int, capacity: int) -> int:
        slots = capacity + PREFILL_CHUNK + 1
        caches = 1 if self.shared_kv else 2
        return caches * B * slots * self.HKV * self.Dh * self.dtype.itemsize

    def state(self) -> list[Tensor]:
        if self.shared_kv:
            return [self.k_cache, self.cache_len]
        return [self.k_cache, self.v_cache, self.cache_len]

    def state_names(self) -> list[str]:
        if self.shared_kv:
            return ["key/value cache", "cache length"]
        return ["key cache", "value cache", "cache length"]

    def empty_record(self, B: int, T: int) -> KVRecord:
        k = torch.zeros(B, T, self.HKV, self.Dh, dtype=self.dtype, device=self.device)
        return KVRecord(k, k if self.shared_kv else torch.zeros_like(k))

    def set_state(self, tensors: Iterator[Tensor]) -> None:
        self.k_cache = next(tensors)
        self.v_cache = self.k_cache if self.shared_kv else next(tensors)
        self.cache_len = next(tensors)

    def check(self, tp: TreePass, pending: LayerCommit | None) -> None:
        """Raises :class:`SpecError` when the pending commit and the longest path of this tree
        would not fit in the cache (read on the host, so not while a CUDA graph records; prefill
        sizes the cache for ``max_new_tokens``, so only a longer run than configured gets
        here)."""
        if tp.static_shapes or not self.cache_len.numel():
            return
        grow = pending.path_len if pending is not None else 0
        # every attention layer commits the same paths: one host read per pass, for all of them
        filled, deepest = tp.shared("attention-filled",
                                    lambda: torch.stack([(self.cache_len + grow).max(), tp.depth.max()]).tolist())
        need = filled + deepest + 1
        if need > self.capacity:
            raise SpecError(f"the KV cache holds {self.capacity} tokens and this pass needs {need}: the run is longer "
                            "than the prefill sized it for (prompt + max_new_tokens + draft depth)")

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        if pending is not None:
            self.commit(pending, tp.kernels)
        q, k, v, gate = self.project(h, self.cache_len[:, None] + tp.depth)
        k = k.to(self.dtype)
        v = k if self.shared_kv else v.to(self.dtype)
        # outside a recorded graph, attend over the filled slots only (read once per pass by
        # check), so a step costs the cache length, not the capacity; a graph reads them all
        filled = tp.memo.get("attention-filled", (0,))[0]
        span = self.k_cache.shape[1] if tp.static_shapes else -(-max(filled, 1) // 64) * 64
        o = tree_attention(q, k, v, self.k_cache[:, :span], self.v_cache[:, :span], self.cache_len, tp.mask,
                           tp.depth, scale=self.scale, window=self.window)
        return self.output(o, gate), KVRecord(k=k, v=v)

    def node_states(self, record: Record, tp: TreePass) -> None:
        return None  # the accepted keys and values are written to the cache whatever the strategy

    def prefills_whole(self, kernels: bool) -> bool:
        return True

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts from the empty cache (:meth:`Mixer.prefill`): causal attention over
        each prompt in one SDPA call (with the sliding window as a mask where the layer has
        one; right padding comes after every real token, so no real query sees it) and the keys
        and values written to slots ``0 .. T - 1``, the cache length set to ``tp.counts`` (the
        padding's slots lie past it, never read)."""
        path, _ = tp.chain()
        q, k, v, gate = self.project(h, path)
        k = k.to(self.dtype)
        v = k if self.shared_kv else v.to(self.dtype)
        T = h.shape[1]
        self.k_cache[:, :T] = k
        if not self.shared_kv:
            self.v_cache[:, :T] = v
        self.cache_len = tp.counts.clone()
        mask = None
        if self.window is not None:  # key s is seen from query t when t - window < s <= t
            steps = path[0]
            mask = (steps[None, :] <= steps[:, None]) & (steps[None, :] > steps[:, None] - self.window)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).to(self.dtype), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=q.shape[2] != self.HKV)
        return self.output(o.transpose(1, 2).to(q.dtype), gate)

    def commit(self, pending: LayerCommit, kernels: bool = False) -> None:
        # a shared cache is written once: the keys are the values
        record, path, path_len = pending
        self.cache_len = commit_kv(self.k_cache, None if self.shared_kv else self.v_cache, self.cache_len, record.k,
                                   None if self.shared_kv else record.v, path, path_len, capacity=self.capacity)


class ProjectedAttention(AttentionMixer):
    """Softmax attention with separate query, key, value and output projections (the layout of
    most transformers attention modules: ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``), the
    model's own modules called on the verify rows, with optional per-head q/k norms, a key
    multiplier and a rotary embedding.

    Args:
        q_proj, k_proj, v_proj, o_proj: the projections (``[B, T, hidden] -> [B, T, heads * Dh]``
            and back).
        num_kv_heads, head_dim: ``HKV`` and ``Dh``; the query head count follows from ``q_proj``.
        dtype, device: the KV cache's.
        scale: softmax scale (the module's own ``scaling``). window: sliding window or ``None``.
        q_norm, k_norm: per-head norms on ``[B, T, heads, Dh]`` (before the rotary embedding),
            or ``None``.
        key_multiplier: keys are scaled by it (Falcon-H1).
        rotary: ``rotary(h, positions [B, T] int64) -> (cos, sin)`` (the model's rotary module),
            or ``None`` for attention without positions (Nemotron-H).
        apply_rotary: ``apply_rotary(q, k, cos, sin, unsqueeze_dim=2) -> (q, k)`` (the model
            file's ``apply_rotary_pos_emb``, which handles its partial rotary).
    """

    def __init__(self, *, q_proj: Callable, k_proj: Callable, v_proj: Callable, o_proj: Callable, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, scale: float | None = None,
                 window: int | None = None, q_norm: Callable | None = None, k_norm: Callable | None = None,
                 key_multiplier: float = 1.0, rotary: Callable | None = None, apply_rotary: Callable | None = None):
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm, self.key_multiplier = q_norm, k_norm, key_multiplier
        self.rotary, self.apply_rotary = rotary, apply_rotary
        super().__init__(num_kv_heads, head_dim, dtype, device, scale=scale, window=window)

    def project(self, h: Tensor, positions: Tensor):
        (B, T), D = h.shape[:2], self.Dh
        q = self.q_proj(h).view(B, T, -1, D)
        k = self.k_proj(h).view(B, T, -1, D)
        v = self.v_proj(h).view(B, T, -1, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.rotary is not None:
            cos, sin = self.rotary(h, positions)
            q, k = self.apply_rotary(q, k, cos, sin, unsqueeze_dim=2)
        return q, k, v, None

    def output(self, o: Tensor, gate: Tensor | None) -> Tensor:
        return self.o_proj(o.reshape(*o.shape[:2], -1))
