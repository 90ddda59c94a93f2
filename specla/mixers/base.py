"""Sequence mixers and the one layer loop that runs a stack of them (docs/architecture.md,
"Mixers").

A model is a stack of layers; each layer holds one or more *sequence mixers* (the parts that
carry state from token to token: a recurrent layer with its short-conv window, a softmax-attention
layer with its KV cache) and position-wise modules (norms, MLP or MoE), which act on each verify
row on its own and so need nothing from specla. A :class:`Mixer` declares its state, verifies a
draft tree from it without writing it, returns a record of the pass, and commits an accepted path
from that record. :class:`specla.model.adapter.ModelAdapter` runs a stack of them in one layer
loop (a plugin wires each layer's mixers and position-wise modules in its
:attr:`specla.model.spec.ModelSpec.block`). :class:`AttentionMixer` is the softmax-attention mixer every
hybrid shares (:mod:`specla.ops.attention`); a plugin supplies its projections.

Shapes: ``B`` sequences, ``T`` verified nodes with the root explicit (node 0, the last committed
token), ``hidden`` model width.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import SpecError
from ..model.prefill import PREFILL_CHUNK
from ..ops import kernels
from ..ops.attention import commit_kv, tree_attention
from ..ops.conv import conv_ancestors, conv_window_after, conv_windows_per_node
from ..records import Record

conv_kernels = kernels("specla.ops.conv_triton")


@dataclass
class TreePass:
    """What every mixer of one forward pass shares.

    Attributes:
        parents: ``[B, T]`` int64 root-explicit parents (``-1``: child of the committed state).
        counts: ``[B]`` int64 real nodes per row (the rest is padding).
        mask: ``[B, T, T]`` bool inclusive-ancestor mask (``None`` in a whole-prompt prefill,
            :meth:`Mixer.prefill`, where the tree is a chain of ``counts`` tokens).
        depth: ``[B, T]`` int64 node depth (the root 0; ``None`` in a whole-prompt prefill).
        records: the commit strategy whose records this pass builds (``factor``, or a baseline of
            :mod:`specla.baselines`: ``snapshot``, ``replay``).
        kernels: whether the plugin's Triton kernels run
            (:meth:`specla.model.adapter.ModelAdapter._use_kernel`).
        static_shapes: a CUDA graph is being recorded: nothing may be read on the host.
        path, path_len: the pending commit's accepted path (``[B, P]``, ``[B]`` int64), applied
            by each mixer before it verifies; ``None`` when nothing is pending.
        choose: ``choose(pick)``: the verify kernel of this pass by a plugin's rule ``pick(parents,
            counts, verify_kernel)``, or the graph-safe one while a graph records
            (:meth:`specla.model.adapter.ModelAdapter._kernel_choice`).
        memo: values a kind of mixer computes once per pass and shares across layers (conv
            ancestors, a verify kernel's plan), keyed by the mixer.
    """

    parents: Tensor
    counts: Tensor
    mask: Tensor | None
    depth: Tensor | None
    records: str
    kernels: bool
    static_shapes: bool
    path: Tensor | None = None
    path_len: Tensor | None = None
    choose: Callable[[Callable], str] | None = None
    memo: dict = field(default_factory=dict)

    def conv_ancestors(self, width: int) -> Tensor:
        """``[B, T, width]`` int64: each node's last ``width`` inputs along its root path, as
        indices into ``[window ; x]`` (:func:`specla.ops.conv.conv_ancestors`; one Triton launch
        on the kernel path), made once per pass for every mixer with a conv of this width."""
        def make():
            return (conv_kernels.conv_ancestors if self.kernels else conv_ancestors)(self.parents, width)

        return self.shared(("conv", width), make)

    def shared(self, key, make: Callable[[], object]):
        """``memo[key]``, made by ``make()`` on first use in this pass."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def chain(self) -> tuple[Tensor, Tensor]:
        """In a whole-prompt prefill (:meth:`Mixer.prefill`): ``(path [B, T] int64, pad [B, T]
        bool)``, each row's chain of node indices (the path that commits a whole prompt, with
        ``counts`` as its length; also its positions) and where the right padding lies; made once
        per pass for every mixer."""
        def make():
            B, T = self.parents.shape
            steps = torch.arange(T, device=self.parents.device)
            return steps.expand(B, T), steps[None] >= self.counts[:, None]

        return self.shared("chain", make)


class Mixer(ABC):
    """One sequence mixer of one layer: its per-sequence state, tree verify and commit.

    Contract: :meth:`verify` never writes the committed state except to apply the ``pending``
    record it is given (the delayed commit of the previous step, with ``tp.path``); the record it
    returns is all :meth:`commit` needs to move the state along any accepted path of the tree;
    ``path_len == 0`` leaves a row's state bit-identical.
    """

    recurrent = True
    """Whether the state is recurrent (fixed-size, float32 or wider: the conformance suite's
    float32 rule) rather than a cache that grows with the sequence."""

    @abstractmethod
    def empty_state(self, B: int, capacity: int) -> None:
        """Zero state for ``B`` sequences; ``capacity``: the tokens a growing cache must hold."""

    def cache_bytes(self, B: int, capacity: int) -> int:
        """Bytes of :meth:`empty_state` that grow with ``capacity`` (a KV cache; 0 for a state
        of fixed size): what a prefill checks against free memory before sizing the caches."""
        return 0

    @abstractmethod
    def state(self) -> list[Tensor]:
        """The state tensors (``[B, ...]`` each), in a fixed order."""

    @abstractmethod
    def set_state(self, tensors: Iterator[Tensor]) -> None:
        """Rebind the state to the next ``len(state())`` tensors of ``tensors``."""

    def recurrent_states(self) -> list[Tensor]:
        """The recurrent states among :meth:`state` (what ``TargetAdapter.recurrent_states``
        lists); none by default."""
        return []

    def state_names(self) -> list[str]:
        """What each tensor of :meth:`state` holds, in its order, for messages (the conformance
        suite names the state that differs from plain decoding's): by default ``'recurrent'``
        for those :meth:`recurrent_states` lists, ``'state j'`` for the others."""
        recurrent = {id(t) for t in self.recurrent_states()}
        return ["recurrent" if id(t) in recurrent else f"state {j}" for j, t in enumerate(self.state())]

    def check(self, tp: TreePass) -> None:
        """Raise :class:`SpecError` if this pass cannot run from the current state; called for
        every mixer before any of them runs, so that a refused pass leaves every state as it
        was. Nothing to check by default."""

    def select(self, index: Tensor) -> None:
        """Keep the sequences ``index`` (``[B']`` int64, on the state's device)."""
        self.set_state(iter([t.index_select(0, index) for t in self.state()]))

    @abstractmethod
    def verify(self, h: Tensor, tp: TreePass, pending: Record | None) -> tuple[Tensor, Record]:
        """Apply ``pending`` along ``tp.path`` (if given), then run the tree ``h`` (``[B, T,
        hidden]``, the layer's normalised input) from the committed state.

        Returns:
            ``(y [B, T, hidden], record)``: the mixer's output (before the layer's residual add)
            and the record :meth:`commit` takes.
        """

    def prefills_whole(self, kernels: bool) -> bool:
        """Whether :meth:`prefill` runs whole prompts in this pass (``kernels``: the plugin's
        Triton kernels run); ``False`` by default: the model's prompts then run as 64-token
        chains through :meth:`verify` and :meth:`commit`."""
        return False

    prefill_continues = False
    """Whether :meth:`prefill` continues from the state the mixer holds (a recurrent state or a
    convolution window, which FLA's chunked kernels take as their initial state), so a prompt
    may run as several fixed-width passes (``SpecConfig.prefill`` ``passes``); attention layers
    write their cache from slot 0 and do not."""

    prefill_by_default = False
    """Whether the default ``SpecConfig.prefill`` (``auto``) takes the passes when every mixer
    continues and says so: a plugin sets it where its passes were measured faster than the chain
    passes and tested on a GPU in half precision (GDN: BENCHMARKS.md section 4)."""

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts ``h [B, T, hidden]`` (the layer's normalised input; row ``b`` holds
        ``tp.counts[b]`` tokens, right-padded) from the state the mixer holds (empty at a prompt's
        start; see :attr:`prefill_continues`): returns the mixer's output ``[B, T, hidden]`` and
        leaves the state each row reaches after its ``counts`` tokens, as a verify of that chain
        followed by its commit would, with no record. ``tp.parents`` is the chain, ``tp.mask``
        and ``tp.depth`` are ``None``. Called only where :meth:`prefills_whole` says so.

        Raises:
            NotImplementedError: the mixer has no whole-prompt path.
        """
        raise NotImplementedError(f"{type(self).__name__} has no whole-prompt prefill")

    @abstractmethod
    def empty_record(self, B: int, T: int) -> Record:
        """The ``factor`` record of a ``T``-row pass with every tensor zeroed, laid out (fields,
        shapes, dtypes, device) as :meth:`verify` returns it: what a pending commit of nothing
        holds (committed with ``path_len == 0`` it changes nothing, and zeros keep every product
        finite), so that a CUDA graph can be recorded before the first step
        (:meth:`specla.model.adapter.ModelAdapter.empty_commit`)."""

    @abstractmethod
    def commit(self, record: Record, path: Tensor, path_len: Tensor, kernels: bool) -> None:
        """Move the state along ``path`` (``[B, P]`` int64 node indices from the root, ``-1``
        padded; ``path_len [B]``) from ``record``; ``kernels``: the plugin's Triton kernels may
        run (float32 state, factor records)."""

    # ------------------------------------------------------------------ optional: the baselines
    baselines: frozenset[str] = frozenset()
    """The research baselines (``SpecConfig.commit`` ``snapshot``, ``replay``; :mod:`specla.baselines`)
    this mixer runs besides the ``factor`` commit every mixer runs: ``snapshot`` where
    :meth:`node_states` is implemented, ``replay`` where :meth:`verify` returns a
    :class:`~specla.baselines.ReplayRecord` in a ``replay`` pass and :meth:`replay` commits it (or
    where its factor record serves that strategy as it is, as a KV cache's does). A model whose
    mixers do not all declare a baseline refuses it (:func:`specla.baselines.check_baselines`)."""

    def node_states(self, record: Record, tp: TreePass) -> list[Tensor] | None:
        """The ``snapshot`` baseline: each tensor of :meth:`state` (in its order) after every node's
        root path, ``[B, T, ...]`` in the state's dtype, from the factor ``record`` that
        :meth:`verify` just returned for ``tp`` (the state is still the pass's starting state);
        ``None`` where the factor record's commit is the snapshot commit already (a KV cache).

        Raises:
            NotImplementedError: the mixer does not declare ``snapshot`` in :attr:`baselines`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not run the snapshot baseline")

    def replay(self, record: Record, path: Tensor, path_len: Tensor) -> None:
        """The ``replay`` baseline's commit: run the recurrence again over each row's accepted
        tokens (``path [B, P]`` int64, ``-1`` padded; ``path_len [B]``) from the pre-step state,
        with their inputs from ``record`` (a :class:`~specla.baselines.ReplayRecord`).

        Raises:
            NotImplementedError: the mixer has no replay record of its own.
        """
        raise NotImplementedError(f"{type(self).__name__} has no replay commit")


class RecurrentMixer(Mixer):
    """A :class:`Mixer` whose state is a recurrent state ``S [B, ...]`` (float32 or wider) and,
    for layers with a short convolution, its window ``conv [B, C - 1, Dc]`` (``None``
    otherwise): the state layout GDN, GLA and Mamba2 layers share."""

    S: Tensor
    conv: Tensor | None
    prefill_continues = True  # the chunked kernels start from S (and the conv window)

    def state(self) -> list[Tensor]:
        return [self.S] + ([self.conv] if self.conv is not None else [])

    def set_state(self, tensors: Iterator[Tensor]) -> None:
        self.S = next(tensors)
        if self.conv is not None:
            self.conv = next(tensors)

    def recurrent_states(self) -> list[Tensor]:
        return [self.S]

    def state_names(self) -> list[str]:
        return ["recurrent"] + (["conv window"] if self.conv is not None else [])

    replay_commit: Callable[..., Tensor]
    """``(S0, *inputs, path, path_len) -> S``: the op's serial recurrence over the accepted tokens
    (the ``inputs`` of a :class:`~specla.baselines.ReplayRecord`), for :meth:`replay`."""

    def replay(self, record: Record, path: Tensor, path_len: Tensor) -> None:
        self.S = self.replay_commit(self.S, *record.inputs, path, path_len)
        self.commit_window(record.conv_x, path, path_len, False)

    def window_states(self, x: Tensor | None, tp: TreePass) -> list[Tensor]:
        """For :meth:`node_states`: ``[]`` without a conv window, else ``[windows [B, T, C - 1,
        Dc]]``, the window after each node's root path from the pass's pre-conv inputs ``x [B, T,
        Dc]`` (:func:`specla.ops.conv.conv_windows_per_node`)."""
        if self.conv is None:
            return []
        return [conv_windows_per_node(x, self.conv, tp.conv_ancestors(self.conv.shape[1] + 1))]

    def commit_window(self, x: Tensor, path: Tensor, path_len: Tensor, kernel: bool) -> None:
        """Move the conv window (``conv [B, C - 1, Dc]``, a no-op without one) along an accepted
        path: its last ``C - 1`` inputs of ``[conv ; x[path]]`` (``x [B, T, Dc]`` the pass's
        pre-conv inputs, rows may be strided; ``path [B, P]`` int64, ``-1`` padded; ``path_len
        [B]``). ``kernel``: in place, one Triton launch
        (:func:`specla.ops.conv_triton.conv_commit`), so a recorded step's window stays its
        static buffer and nothing is copied back after the step; else
        :func:`specla.ops.conv.conv_window_after` into a new tensor."""
        if self.conv is None:
            return
        if kernel and self.conv.is_contiguous():
            conv_kernels.conv_commit(x, self.conv, path, path_len, out=self.conv)
        elif kernel:  # a strided window (a view given as state) cannot be written in place
            self.conv = conv_kernels.conv_commit(x, self.conv, path, path_len)
        else:
            self.conv = conv_window_after(x, self.conv, path, path_len)


@dataclass(frozen=True)
class KVRecord(Record):
    """An attention mixer's record: every node's key and value. The commit writes the accepted
    path's into the cache; the strategies (factor and the baselines) coincide for a KV cache."""

    k: Tensor  # [B, T, HKV, Dh] cache dtype, rotary embedding applied
    v: Tensor  # [B, T, HKV, Dh] cache dtype (``k`` itself for a mixer with ``shared_kv``)


class AttentionMixer(Mixer):
    """Softmax attention over a KV cache of fixed capacity, verified over a draft tree
    (:func:`specla.ops.attention.tree_attention`: each node sees the committed cache and its own
    ancestors) and committed by writing the accepted path's keys and values
    (:func:`specla.ops.attention.commit_kv`; rejected nodes never reach the cache). Lengths live on
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

    def check(self, tp: TreePass) -> None:
        """Raises :class:`SpecError` when the pending commit and the longest path of this tree
        would not fit in the cache (read on the host, so not while a CUDA graph records; prefill
        sizes the cache for ``max_new_tokens``, so only a longer run than configured gets
        here)."""
        if tp.static_shapes or not self.cache_len.numel():
            return
        grow = tp.path_len if tp.path_len is not None else 0
        # every attention layer commits the same paths: one host read per pass, for all of them
        filled, deepest = tp.shared("attention-filled",
                                    lambda: torch.stack([(self.cache_len + grow).max(), tp.depth.max()]).tolist())
        need = filled + deepest + 1
        if need > self.capacity:
            raise SpecError(f"the KV cache holds {self.capacity} tokens and this pass needs {need}: the run is longer "
                            "than the prefill sized it for (prompt + max_new_tokens + draft depth)")

    def verify(self, h: Tensor, tp: TreePass, pending: Record | None) -> tuple[Tensor, Record]:
        if pending is not None:
            self.commit(pending, tp.path, tp.path_len, tp.kernels)
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

    def commit(self, record: Record, path: Tensor, path_len: Tensor, kernels: bool = False) -> None:
        # a shared cache is written once: the keys are the values
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


def experts_graph_problem(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """Why the MoE experts of a transformers ``model`` cannot be recorded in a CUDA graph, or
    ``None``: transformers' eager experts find the experts hit on the host (``nonzero``);
    ``batched_mm`` records, and so does ``grouped_mm`` in bfloat16 (transformers' default for a
    loaded checkpoint). For :attr:`specla.model.spec.ModelSpec.graph_problem`."""
    for m in model.modules():
        if not hasattr(m, "has_gate"):  # transformers' experts modules carry it
            continue
        impl = m.config._experts_implementation
        if not (impl == "batched_mm" or (impl == "grouped_mm" and dtype == torch.bfloat16)):
            return (f"the MoE experts run transformers' {impl or 'eager'!r} implementation, which a CUDA graph "
                    "cannot record here (load the model with experts_implementation='batched_mm', or 'grouped_mm' "
                    "in bfloat16)")
    return None
