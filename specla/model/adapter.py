"""The one :class:`~specla.interfaces.TargetAdapter` every model runs through: a plugin describes
its model as data (:class:`~specla.model.spec.ModelSpec`: embeddings, blocks calling sequence
mixers, LM head) and :class:`ModelAdapter` owns everything else: placement, the layer loop over a
draft tree, the mixers' states, the delayed (``factor``) or eager commit, prefill, batch selection
and the CUDA-graph state.

Shapes: ``B`` sequences, ``T`` rows of a pass with the root explicit (node 0, the last committed
token), ``hidden`` the model width, ``vocab`` its vocabulary.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ..baselines import baseline_record, check_baselines, commit_record
from ..config import SpecConfig
from ..errors import ConfigError, SpecError
from ..cuda.capture import copy_into, record_graph
from ..hf import weaken_hook_cycles
from ..interfaces import TargetAdapter, VerifyOutput
from ..memory import cache_capacity, check_cache_memory
from ..mixers.base import PREFILL_CHUNK, Mixer, TreePass
from ..ops import compiled_kernels_loaded, kernels, upload_ints
from ..ops.norm import compute_dtype
from ..records import Acceptance, PendingCommit, Record
from ..tree import DraftTree, inclusive_ancestor_mask
from . import prefill
from .spec import ModelSpec, Placement

tree_kernels = kernels("specla.ops.tree_triton")


def place(model: torch.nn.Module, config: SpecConfig, differentiable: bool) -> tuple[torch.nn.Module, Placement]:
    """The run's placement and the model whose modules it calls.

    Device and dtype are ``config.device`` / ``config.dtype`` when given, else those of the
    model's output embedding (``get_output_embeddings()``, its first parameter for a model without
    one); ``"cuda"`` means the current GPU; the state dtype is float32 (float64 in float64 runs).
    The model is ``model`` itself when it is on that device in that dtype and in eval mode (or
    ``differentiable``: gradients must reach the caller's parameters), else a converted copy in
    eval mode; the caller's model is never modified.

    Raises:
        ConfigError: ``kernels="triton"`` without Triton installed, on a non-CUDA device without
            ``TRITON_INTERPRET=1``, or with it set only after Triton kernels were defined compiled
            (specla's or FLA's).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    ref = head.weight if head is not None else next(model.parameters())
    device = torch.device(config.device) if config.device else ref.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.empty(0, device=device).device  # canonical: "cpu:0" is "cpu"
    dtype = getattr(torch, config.dtype) if config.dtype else ref.dtype
    if config.engine.kernels == "triton" and importlib.util.find_spec("triton") is None:
        raise ConfigError("kernels='triton' needs Triton, which is not installed (pip install triton; CUDA builds "
                          "of torch bring it); use kernels='auto' or 'reference'")
    if config.engine.kernels == "triton" and device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"kernels='triton' on {device.type} needs TRITON_INTERPRET=1 (Triton's CPU "
                              "interpreter, for tests), set before Python starts; use kernels='auto' or "
                              "'reference'")
        if compiled_kernels_loaded():
            raise ConfigError(f"kernels='triton' on {device.type}: TRITON_INTERPRET=1 was set after "
                              "Triton kernels (specla's or FLA's) were loaded as compiled kernels (Triton "
                              "decides when a kernel is defined); set it before Python starts")
    copied = not differentiable and (ref.device != device or ref.dtype != dtype or model.training)
    if copied:
        model = weaken_hook_cycles(copy.deepcopy(model).to(device, dtype).eval())
    triton = config.engine.kernels == "triton" or (config.engine.kernels == "auto" and device.type == "cuda")
    return model, Placement(device, dtype, compute_dtype(torch.empty(0, dtype=dtype)), triton, differentiable, copied)


class ModelAdapter(TargetAdapter):
    """A model described by its plugin's :class:`ModelSpec`, prepared for speculative decoding.
    Final: plugins return data (``ArchitecturePlugin.model_spec``); this class is never
    subclassed.

    State: every mixer's (:meth:`Mixer.state`: recurrent states and conv windows, KV caches),
    ``roots [B]`` int64, ``last_hidden [B, hidden]`` and, with the ``factor`` commit, the pending
    commit (:attr:`pending`, a :class:`PendingCommit` built once per step by :meth:`commit`: one
    :class:`~specla.records.LayerCommit` per mixer, in :attr:`mixers` order), each mixer's part
    applied inside the next verify.

    Args:
        model: the model to run (see :func:`place` for when it is copied).
        config: the run's :class:`SpecConfig`.
        build: the plugin's ``model_spec(model, placement) -> ModelSpec``.
        differentiable: keep autograd graphs through the weights (target training through
            :meth:`score`; the plugin's Triton kernels, which have no gradients, then never run).
    Raises:
        ConfigError: see :func:`place`; UnsupportedModelError: the builder refuses the model.

    Attributes:
        placement: the run's :class:`Placement` (``device``, ``dtype``, ``state_dtype`` and
            ``differentiable`` are copied onto the adapter).
        model: the model the spec's callables run (the adapter's copy where it made one).
        mixers, num_layers, embed_weight, embed_scale: the spec's (:class:`ModelSpec`).
        capacity: the tokens each attention cache holds, sized by prefill.
    """

    static_shapes: bool = False
    """Set by :class:`specla.cuda.graph_step.GraphRunner` while it records a step (and by the fixed-shape
    prefill passes): every operation must then be one a CUDA graph can capture (no host reads of
    device values, e.g. no kernel choice from the tree's shape; fixed tensor shapes)."""

    graph_kernel_nodes = 63
    """The largest draft budget ``N`` whose verify a CUDA graph can record with the Triton
    kernels: the parallel kernel (the one launch that needs nothing from the host) holds trees of
    up to 64 nodes, the root included."""

    def __init__(self, model: torch.nn.Module, config: SpecConfig,
                 build: Callable[[torch.nn.Module, Placement], ModelSpec], *, differentiable: bool = False):
        model, self.placement = place(model, config, differentiable)
        self.config = config
        self.device, self.dtype = self.placement.device, self.placement.dtype
        self.state_dtype, self.differentiable = self.placement.state_dtype, differentiable
        spec = build(model, self.placement)
        self.model, self.embed_weight, self.embed_scale = spec.model, spec.embed_weight, spec.embed_scale
        self.vocab_size, self.eos_token_ids = spec.embed_weight.shape[0], spec.eos_token_ids
        self.mixers: list[Mixer] = list(spec.mixers)
        check_baselines(self.mixers, config.engine.commit)
        self.num_layers, self._spec = spec.num_layers, spec
        self.capacity = 0  # the tokens each attention cache holds (set by prefill)
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_hidden = torch.zeros(0, self.embed_weight.shape[1], dtype=self.dtype, device=self.device)
        self.pending: PendingCommit | None = None
        self._prefill_graphs: dict[int, prefill.PrefillGraph] = {}  # recorded prefill passes per batch size

    @property
    def triton_kernels(self) -> bool:
        """Whether the plugin's Triton kernels may run (:attr:`Placement.triton_kernels`)."""
        return self.placement.triton_kernels

    def _use_kernel(self, records: str) -> bool:
        """Whether a pass runs the Triton kernels: they may run here, the records are factor
        records, the state is float32 and no gradient is needed (the kernels have none)."""
        return (self.triton_kernels and records == "factor" and self.state_dtype == torch.float32
                and not self.differentiable)

    def _block(self, li: int, x: Tensor, mix: Callable[[Tensor], Tensor], kernels: bool) -> Tensor:
        """Layer ``li`` on the residual stream (:attr:`ModelSpec.block`)."""
        return self._spec.block(li, x, mix, kernels)

    # ------------------------------------------------------------------ features
    def embed(self, tokens: Tensor) -> Tensor:
        """Input embeddings ``[..., hidden]`` of ``tokens`` (int64, any shape): rows of
        ``embed_weight`` times ``embed_scale``."""
        x = self.embed_weight[tokens]
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def embedding_table(self) -> Tensor | None:
        """``embed_weight`` where ``embed_scale`` is 1, else ``None`` (see
        :meth:`specla.interfaces.TargetAdapter.embedding_table`)."""
        return self.embed_weight if self.embed_scale == 1.0 else None

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., vocab]`` of last-layer features ``[..., hidden]`` (:attr:`ModelSpec.logits`)."""
        return self._spec.logits(hidden)

    # ------------------------------------------------------------------ state
    @property
    def batch_size(self) -> int:
        return self._roots.shape[0]

    @property
    def roots(self) -> Tensor:
        return self._roots

    def _empty_state(self, B: int) -> None:
        for m in self.mixers:
            m.empty_state(B, self.capacity)

    def _state_list(self) -> list[Tensor]:
        """Every mixer's state tensors, in :attr:`mixers` order."""
        return [t for m in self.mixers for t in m.state()]

    def _set_state_list(self, tensors: Iterable[Tensor]) -> None:
        """Rebind the mixers' states to the first tensors of ``tensors`` (the layout of
        :meth:`_state_list`); an iterator is left at the first tensor not taken."""
        it = iter(tensors)
        for m in self.mixers:
            m.set_state(it)

    @torch.no_grad()
    def flush(self) -> None:
        if self.pending is not None:
            self._apply(self.pending)
            self.pending = None

    def recurrent_states(self) -> list[Tensor]:
        self.flush()
        return [t for m in self.mixers for t in m.recurrent_states()]

    def select(self, index: Tensor) -> None:
        index = index.to(self.device)
        for m in self.mixers:
            m.select(index)
        self._roots = self._roots.index_select(0, index)
        self.last_hidden = self.last_hidden.index_select(0, index)
        if self.pending is not None:
            self.pending = self.pending.select(index)

    def _size_caches(self, B: int, longest: int) -> None:
        """Set :attr:`capacity` for ``B`` sequences of up to ``longest`` prompt tokens, refusing
        (:class:`ConfigError`, nothing changed) caches the device cannot hold."""
        capacity = cache_capacity(self.capacity, longest, self.config)
        held = sum(m.cache_bytes(m.state()[0].shape[0], self.capacity) for m in self.mixers if m.state())
        check_cache_memory(sum(m.cache_bytes(B, capacity) for m in self.mixers), held, self.device,
                           "the attention layers' KV caches", self.config)
        self.capacity = capacity

    # ------------------------------------------------------------------ passes
    def _kernel_choice(self, pick, parents: Tensor, counts: Tensor) -> str:
        """The verify kernel of this pass: the plugin's rule ``pick(parents, counts,
        config.engine.verify_kernel)`` (it may read the tree on the host), or, while a CUDA graph is
        recorded (``static_shapes``), a kernel whose launch reads nothing on the host: ``serial``
        for one-token passes (plain decoding: a chain of one; far faster than the parallel
        kernel there, docs/tuning.md, "One-token passes in a recorded step"), else
        ``parallel``; ``graph_kernel_nodes`` keeps recorded trees within its size."""
        if self.static_shapes:
            return "serial" if parents.shape[1] == 1 else "parallel"
        return pick(parents, counts, self.config.engine.verify_kernel)

    def forward(self, tokens: Tensor, parents: Tensor, counts: Tensor, records: str, logits: bool = True,
                pending: PendingCommit | None = None):
        """Run the model over ``[B, T]`` trees hanging from the committed state (``parents`` int64,
        ``-1`` = child of the state; ``counts [B]`` real nodes); each mixer applies its part of
        ``pending`` (``pending.layers[i]`` to mixer ``i``) first.

        Returns:
            ``(logits [B, T, vocab] or None, hidden [B, T, hidden], records)``, one record per
            mixer of the kind ``records`` names.
        """
        if self.triton_kernels:  # one launch (a recorded step is bound by its launches)
            mask, depth = tree_kernels.ancestor_mask(parents)
        else:
            mask = inclusive_ancestor_mask(parents)
            depth = mask.sum(-1) - 1
        tp = TreePass(parents, counts, mask, depth, records, self._use_kernel(records), self.static_shapes,
                      choose=lambda pick: self._kernel_choice(pick, parents, counts))
        layers = pending.layers if pending is not None else (None,) * len(self.mixers)
        for m, layer in zip(self.mixers, layers):
            m.check(tp, layer)
        out_records: list[Record] = []

        def mix(h: Tensor) -> Tensor:
            i = len(out_records)  # the mixers run in self.mixers order
            y, rec = self.mixers[i].verify(h, tp, layers[i])
            out_records.append(baseline_record(self.mixers[i], rec, tp))
            return y

        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            x = self.embed(tokens)
            for li in range(self.num_layers):
                x = self._block(li, x, mix, tp.kernels)
            out = self.lm_logits(x) if logits else None
        # the residual stream may be wider than the activations (residual_in_fp32); features are
        # returned in the activation dtype
        return out, x.to(self.dtype), tuple(out_records)

    def _apply(self, pending: PendingCommit) -> None:
        """Commit ``pending`` to every mixer, ``pending.layers[i]`` to mixer ``i``."""
        kernels = self._use_kernel("factor")
        for m, layer in zip(self.mixers, pending.layers):
            commit_record(m, layer, kernels)

    def _run_whole(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Whole prompts ``tokens [B, T]`` int64 (right-padded, ``lengths [B]``) through every
        mixer's :meth:`Mixer.prefill`, from the state the mixers hold; returns ``[B, T, hidden]``."""
        B, T = tokens.shape
        parents = torch.arange(-1, T - 1, device=self.device).expand(B, T)
        tp = TreePass(parents, lengths, None, None, "factor", self._use_kernel("factor"), False)
        order = iter(self.mixers)  # the layers call their mixers in self.mixers order

        def mix(h: Tensor) -> Tensor:
            return next(order).prefill(h, tp)

        x = self.embed(tokens)
        for li in range(self.num_layers):
            x = self._block(li, x, mix, tp.kernels)
        return x.to(self.dtype)

    def _run_chunks(self, tokens: Tensor, lengths: Tensor, logits: bool = False) -> tuple[Tensor | None, Tensor]:
        """Run every sequence's tokens into its state, ``PREFILL_CHUNK`` at a time (chains).

        Args: tokens ``[B, T]`` int64 (right-padded), lengths ``[B]`` int64.
        Returns: ``([B, T, vocab]`` logits or ``None``, ``[B, T, hidden]`` last-layer features).
        """
        outs, feats = [], []
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            chunk = tokens[:, start : start + PREFILL_CHUNK]
            W = chunk.shape[1]
            n = (lengths - start).clamp(0, W)
            tree = DraftTree(chunk, torch.arange(-1, W - 1, device=self.device).expand_as(chunk).contiguous(), n)
            lg, hidden, recs = self.forward(tree.tokens, tree.parents, n, "factor", logits=logits)
            outs.append(lg)
            feats.append(hidden)
            path = torch.where(tree.valid, torch.arange(W, device=self.device), -1)
            self._apply(PendingCommit.from_records(recs, path, n))
        return (torch.cat(outs, 1) if logits else None), torch.cat(feats, 1)

    def score(self, tokens: Tensor, return_hidden: bool = False):
        """Teacher-forced logits of whole sequences from an empty state: chunked chains, or with
        :attr:`ModelSpec.score_sequences` each layer over the whole sequences at once. Discards
        any batch the adapter held.

        Args:
            tokens: ``[B, T]`` int64, ``T >= 1``.
            return_hidden: also return the last-layer features ``[B, T, hidden]``.
        Returns:
            ``[B, T, vocab]`` logits in the activation dtype (and the features); differentiable
            with respect to the model's parameters when the adapter is ``differentiable``.
        """
        self.pending = None
        tokens = tokens.to(self.device)
        B = tokens.shape[0]
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            if self._spec.score_sequences:
                self._empty_state(0)
                self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
                x = self.embed(tokens)
                for li, mixer in enumerate(self.mixers):
                    x = self._block(li, x, lambda h, m=mixer: m.sequence(h, PREFILL_CHUNK), False)
                logits, hidden = self.lm_logits(x), x
            else:
                self._size_caches(B, tokens.shape[1])
                self._empty_state(B)
                self._roots = torch.zeros(B, dtype=torch.int64, device=self.device)
                lengths = torch.full((B,), tokens.shape[1], dtype=torch.int64, device=self.device)
                logits, hidden = self._run_chunks(tokens, lengths, logits=True)
        return (logits, hidden) if return_hidden else logits

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def _prefill(self, prompts: list[list[int]]) -> None:
        B = len(prompts)
        self._size_caches(B, max(len(p) for p in prompts))
        self.pending, self.prompt_hidden = None, None
        self._empty_state(B)
        bodies = [p[:-1] for p in prompts]
        T = max(len(b) for b in bodies)
        self.last_hidden = torch.zeros(B, self.embed_weight.shape[1], dtype=self.dtype, device=self.device)
        self.prefill_form = ""  # one-token prompts: nothing runs
        # one upload that does not stall the host (upload_ints): roots, lengths, then the tokens
        up = upload_ints([p[-1] for p in prompts] + [len(b) for b in bodies]
                         + [t for b in bodies for t in b + [0] * (T - len(b))], self.device)
        roots = up[:B]
        if T:
            lengths, tokens = up[B : 2 * B], up[2 * B :].view(B, T)
            mode = self._prefill_mode(B)
            self.prefill_form = ("chunked" if mode == "whole" else
                                 "passes" if mode is not None and self._chunk_passes() else "chain")
            if mode == "whole":
                hidden = self._run_whole(tokens, lengths)
            elif mode is None:
                _, hidden = self._run_chunks(tokens, lengths)
            else:
                hidden = self._run_chunks_static(tokens, lengths, record=mode == "record")
            last = hidden[torch.arange(B, device=self.device), (lengths - 1).clamp(min=0)]
            self.last_hidden = torch.where((lengths > 0)[:, None], last, self.last_hidden)
            self.prompt_hidden = hidden
        self._roots = roots

    def _whole_prefill(self) -> bool:
        """Whether prompts run as one pass over whole sequences (``SpecConfig.engine.prefill``
        ``chunked``, where every mixer has a whole-prompt form) rather than as 64-token chains."""
        kernels = self._use_kernel("factor")
        return self.config.engine.prefill == "chunked" and all(m.prefills_whole(kernels) for m in self.mixers)

    def _chunk_passes(self) -> bool:
        """Whether the fixed-shape prefill passes run every mixer's chunked whole-sequence
        kernels from the state the previous pass left (``PREFILL_PASS`` tokens each,
        ``SpecConfig.engine.prefill`` ``passes``, or ``auto`` in half precision where every mixer takes
        them by default) rather than a 64-token verify chain and its commit."""
        kernels = self._use_kernel("factor")
        # auto: only in half precision, since FLA's chunked kernels multiply float32 in TF32 and a
        # float32 run keeps the exact chain passes
        wanted = self.config.engine.prefill == "passes" or (
            self.config.engine.prefill == "auto" and self.dtype in (torch.bfloat16, torch.float16)
            and all(m.prefill_by_default for m in self.mixers))
        return wanted and all(m.prefills_whole(kernels) and m.prefill_continues for m in self.mixers)

    def _prefill_mode(self, B: int) -> str | None:
        """How this prefill runs its passes: ``"whole"`` (one pass over whole prompts,
        :meth:`_whole_prefill`), ``"record"`` (one CUDA graph per batch size,
        replayed per chunk of the prompts: the plugin's kernels on a GPU with ``cuda_graphs`` on
        or auto), ``"unrecorded"`` (the same fixed-shape pass run eagerly: ``cuda_graphs=
        "unrecorded"``, how the CPU tests check it, and :meth:`_chunk_passes` wherever no graph
        is recorded) or ``None`` (eager chain passes of the chunk's own width)."""
        graphs = self.config.engine.cuda_graphs
        if self._whole_prefill():
            return "whole"
        eager = "unrecorded" if self._chunk_passes() else None
        if B > prefill.PREFILL_GRAPH_MAX_BATCH or self.differentiable or self.graph_problem():
            return eager
        if graphs == "unrecorded":
            return "unrecorded"
        if graphs in ("auto", "on") and self.device.type == "cuda" and self._use_kernel("factor"):
            return "record"
        return eager

    def _prefill_pass(self, g: prefill.PrefillGraph) -> None:
        """One pass on ``g``'s static buffers (a 64-token chain through verify and its commit, or
        with :meth:`_chunk_passes` the mixers' chunked kernels over ``PREFILL_PASS`` tokens) and
        the new state copied back into them: what a recorded prefill graph holds."""
        self._set_state_list(g.state)
        self.static_shapes = True
        try:
            if self._chunk_passes():
                hidden = self._run_whole(g.tokens, g.counts)
            else:
                _, hidden, recs = self.forward(g.tokens, g.parents, g.counts, "factor", logits=False)
                W = g.tokens.shape[1]
                idx = torch.arange(W, device=self.device)
                self._apply(PendingCommit.from_records(recs, torch.where(idx < g.counts[:, None], idx, -1), g.counts))
        finally:
            self.static_shapes = False
        copy_into(g.state + [g.hidden], self._state_list() + [hidden])
        self._set_state_list(g.state)

    def _run_chunks_static(self, tokens: Tensor, lengths: Tensor, record: bool) -> Tensor:
        """:meth:`_run_chunks` (no logits) with fixed-shape passes (``PREFILL_CHUNK`` tokens, or
        ``PREFILL_PASS`` with :meth:`_chunk_passes`) on static buffers, recorded once per batch
        size and replayed per chunk when ``record`` (see :meth:`_prefill_mode`); the state starts
        empty. Returns ``[B, T, hidden]``."""
        B, T = tokens.shape
        W = prefill.PREFILL_PASS if self._chunk_passes() else PREFILL_CHUNK
        graphs = self._prefill_graphs
        g = graphs.get(B) if record else None
        if g is not None and (g.tokens.shape[1] != W
                              or any(a.shape != b.shape for a, b in zip(g.state, self._state_list()))):
            g = None  # another pass width, or a state sized per run changed (an attention cache grew)
        if g is None:
            g = prefill.PrefillGraph(torch.zeros(B, W, dtype=torch.int64, device=self.device),
                                     torch.arange(-1, W - 1, device=self.device).expand(B, W).contiguous(),
                                     torch.zeros(B, dtype=torch.int64, device=self.device),
                                     [t.clone() for t in self._state_list()],
                                     torch.zeros(B, W, self.embed_weight.shape[1], dtype=self.dtype,
                                                 device=self.device))
            if record:
                g.graph = record_graph(lambda: self._prefill_pass(g), self.device)
                graphs[B] = g
        torch._foreach_zero_(g.state)  # a new batch starts from the empty state
        feats = []
        for start in range(0, T, W):
            n = min(W, T - start)
            g.tokens[:, :n].copy_(tokens[:, start : start + n])
            g.tokens[:, n:].zero_()
            g.counts.copy_((lengths - start).clamp(0, W))
            if g.graph is not None:
                g.graph.replay()
            else:
                self._prefill_pass(g)
            feats.append(g.hidden[:, :n].clone())
        self._set_state_list([t.clone() for t in g.state])  # the graph's buffers serve the next prefill
        return torch.cat(feats, 1)

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def _verify(self, tree: DraftTree) -> VerifyOutput:
        pending, self.pending = self.pending, None  # delayed commit: applied inside this pass
        self.prompt_hidden = None  # read by the drafter's reset; not kept through decoding
        tokens = torch.cat([self._roots[:, None], tree.tokens], 1)
        try:
            logits, hidden, recs = self.forward(tokens, tree.parents_with_root, tree.num_nodes + 1,
                                                self.config.engine.commit, pending=pending)
        except SpecError:  # refused before any state moved (Mixer.check): the commit stays pending
            self.pending = pending
            raise
        return VerifyOutput(logits=logits, hidden=hidden, records=recs)

    @torch.no_grad()
    def _commit(self, tree: DraftTree, out: VerifyOutput, acceptance: Acceptance) -> None:
        pending = PendingCommit.from_records(out.records, acceptance.path, acceptance.path_len)
        if self.config.engine.commit == "factor":
            self.pending = pending
        else:
            self._apply(pending)
        self._roots = acceptance.bonus.to(self.device)

    # ------------------------------------------------------------------ CUDA graphs
    def graph_problem(self) -> str | None:
        """Why the passes cannot be recorded in a CUDA graph although the plugin declares the
        ``cuda_graphs`` capability (:attr:`ModelSpec.graph_problem`: a module of the checkpoint
        that reads values on the host, say), or ``None``. Steps and prefill then run eagerly under
        ``cuda_graphs="auto"``, and ``"on"`` / ``"unrecorded"`` raise :class:`ConfigError` with
        this text."""
        return self._spec.graph_problem

    def graph_max_nodes(self) -> int:
        """The largest draft budget ``N`` a recorded verify holds: ``graph_kernel_nodes`` on the
        Triton path (with float32 state and factor records), 1024 on the PyTorch reference path."""
        return self.graph_kernel_nodes if self._use_kernel(self.config.engine.commit) else 1024

    def graph_state(self) -> list[Tensor] | None:
        """Every tensor a decoding step reads and replaces, in a fixed order: every mixer's state
        (:meth:`_state_list`), ``roots``, then, with the ``factor`` commit, the pending commit's
        (:meth:`PendingCommit.tensors`: record fields mixer by mixer, ``path`` and ``path_len``).
        ``None`` while a ``factor`` run has no pending commit yet (before its first step, see
        :meth:`empty_commit`): its record shapes are not known.
        :class:`specla.cuda.graph_step.GraphRunner` keeps static copies of them and rebinds them
        with :meth:`set_graph_state`."""
        out = [*self._state_list(), self._roots]
        if self.config.engine.commit == "factor":
            if self.pending is None:
                return None
            self._pending_template = self.pending
            out += self.pending.tensors()
        return out

    def empty_commit(self, nodes: int, depth: int) -> None:
        """With the ``factor`` commit and nothing pending (just after a prefill or a flush), make
        the pending commit one of nothing, laid out as a step with trees of ``nodes`` draft nodes
        and paths of up to ``depth`` drafts leaves it: ``PendingCommit(every mixer's empty record
        of nodes + 1 rows, path [B, depth + 1] of -1, path_len 0)``, so that :meth:`graph_state`
        lists what a recorded step of that budget reads; called by
        :class:`specla.cuda.graph_step.GraphRunner` before it lists the state. A no-op otherwise."""
        if self.config.engine.commit != "factor" or self.pending is not None:
            return
        B, dev = self.batch_size, self.device
        self.pending = PendingCommit.from_records([m.empty_record(B, nodes + 1) for m in self.mixers],
                                                  torch.full((B, depth + 1), -1, dtype=torch.int64, device=dev),
                                                  torch.zeros(B, dtype=torch.int64, device=dev))

    def set_graph_state(self, tensors: list[Tensor]) -> None:
        """Rebind the state to ``tensors`` (the layout of :meth:`graph_state`)."""
        it = iter(tensors)
        self._set_state_list(it)
        self._roots = next(it)
        if self.config.engine.commit == "factor":
            self.pending = self._pending_template.rebind(it)
            self._pending_template = self.pending  # the template holds the bound tensors, nothing older
