"""The adapter machinery every bundled plugin shares: a model run layer-major over a draft tree
from per-layer recurrent states and conv windows, with the delayed (``factor``) or eager commit.
Architecture-agnostic: a plugin supplies the layers' math (:meth:`LayerwiseAdapter.forward`), how
a commit moves its states (:meth:`LayerwiseAdapter._apply`) and empty states."""

from __future__ import annotations

import inspect
import os
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from numbers import Integral

import torch
from torch import Tensor

from .errors import ConfigError, SpecError, UnsupportedModelError
from .graphs import copy_into, record_graph
from .interfaces import TargetAdapter, VerifyOutput
from .ops import upload_ints
from .ops.norm import compute_dtype, rms_norm
from .records import Acceptance, PendingCommit, Record
from .tree import DraftTree

PREFILL_CHUNK = 64  # prompt tokens per prefill pass; each pass is a chain through the tree path
PREFILL_PASS = 256  # prompt tokens per pass through the mixers' chunked kernels (``prefill="passes"``)
# prefill passes run as one recorded CUDA graph up to this many prompts (where a pass is bound by
# its launches); each recorded batch size keeps a pass's buffers (and a chain pass's records) in its pool
PREFILL_GRAPH_MAX_BATCH = 8


@dataclass
class _PrefillGraph:
    """One recorded prefill pass for ``B`` prompts: static inputs, state and output."""

    tokens: Tensor  # [B, W] int64, the chunk (padding 0); W: PREFILL_CHUNK, or PREFILL_PASS for passes
    parents: Tensor  # [B, W] int64, a chain
    counts: Tensor  # [B] int64, the chunk's real tokens per prompt
    state: list[Tensor]  # recurrent states, then conv windows
    hidden: Tensor  # [B, W, hidden] last-layer features
    graph: "torch.cuda.CUDAGraph | None" = None


def eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """The end-of-sequence ids a model's generation stops at, as transformers' ``generate`` reads
    them: ``model.generation_config.eos_token_id`` (filled from the checkpoint's
    ``generation_config.json`` when it has one) when set, else ``model.config.eos_token_id``.
    Either may be one id or a list of ids.

    Args:
        model: a transformers-style model (``generation_config`` and ``config`` are optional).
    Returns:
        The ids in their given order without repeats; ``()`` when neither is set.
    Raises:
        UnsupportedModelError: an id that is not an integer (a bool, a float, a string...).
    """
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    source = "generation_config"
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
        source = "config"
    if eos is None:
        return ()
    ids = eos.tolist() if isinstance(eos, Tensor) else eos
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise UnsupportedModelError(f"{source}.eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(dict.fromkeys(int(t) for t in ids))


def weaken_hook_cycles(model: torch.nn.Module) -> torch.nn.Module:
    """Make the hooks of ``model``'s modules that are bound methods of one of its modules hold
    that module weakly, as torch's own ``with_module`` hooks do; each is called as before. A
    module's own bound method in its hook table is a reference cycle (transformers' and FLA's
    ``Mamba2Model`` register ``self.load_hook`` as a ``load_state_dict`` pre-hook), which keeps
    the whole model alive after its last user drops it, until Python's cyclic garbage collector
    runs. Only for models specla owns (loaded or copied by it).

    Returns:
        ``model``, changed in place.
    """
    from torch.nn.modules.module import _WrappedHook

    owners = {id(m) for m in model.modules()}
    for module in model.modules():
        tables = [t for name, t in vars(module).items() if name.endswith("hooks") and isinstance(t, dict)]
        for table in tables:
            for key, hook in table.items():
                fn = hook.hook if isinstance(hook, _WrappedHook) and not hook.with_module else hook
                if inspect.ismethod(fn) and id(fn.__self__) in owners:
                    table[key] = _WrappedHook(fn.__func__, fn.__self__)
    return model


def compiled_kernels_loaded() -> bool:
    """Whether a loaded module defines Triton kernels compiled, not interpreted: specla's own
    (``specla.ops.*_triton``, a plugin's kernel modules) or a library's (FLA's, which loading an FLA
    model imports). ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, so
    setting it later does not make those run on the CPU, and Triton's interpreter then fails in
    kernels defined after it too."""
    import sys

    triton = sys.modules.get("triton")
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, KernelInterface

    def compiled(v) -> bool:
        while isinstance(v, KernelInterface) and not isinstance(v, (JITFunction, InterpretedFunction)):
            v = getattr(v, "fn", None)  # autotuners and heuristics wrap the kernel
        return type(v) is JITFunction  # @triton.jit's; Gluon's subclass is never interpreted

    # the modules that imported Triton as a name of their own: those that define kernels
    mods = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("triton") is triton]
    return any(compiled(v) for m in mods for v in list(vars(m).values()))


class LayerwiseAdapter(TargetAdapter):
    """A :class:`TargetAdapter` whose state is, per layer, ``recurrent[l]`` (``[B, ...]``, float32
    or float64) and ``conv[l]`` (``[B, C - 1, D]`` or ``None``), plus ``roots [B]``, ``last_hidden
    [B, hidden]`` and an optional :class:`PendingCommit`.

    Subclasses set ``embed_weight``, ``norm``, ``norm_eps``, ``lm_head``, ``device``, ``dtype``,
    ``state_dtype`` and ``config`` (and ``differentiable`` when they can train), call
    :meth:`_init_state` in ``__init__``, and implement :meth:`_empty_state`, :meth:`forward` and
    :meth:`_apply`.

    What the adapter holds (its mixers, their ``project`` / ``output`` closures) refers to values
    (dtypes, flags, weights, the model's modules), never back to the adapter: a dropped decoder
    then frees the adapter, its model copy, states and caches at once, by reference counting,
    rather than whenever Python's cyclic garbage collector next runs.
    """

    differentiable = False  # True: forward keeps autograd graphs (target training)

    def _place(self, config, ref: Tensor) -> None:
        """Set ``config``, ``device``, ``dtype`` and ``state_dtype``: ``config.device`` and
        ``config.dtype`` when given, else those of the model's parameter ``ref``; ``"cuda"``
        means the current GPU; the state dtype is float32 (float64 for float64 runs)."""
        self.config = config
        device = torch.device(config.device) if config.device else ref.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.empty(0, device=device).device  # canonical: "cpu:0" is "cpu"
        self.dtype = getattr(torch, config.dtype) if config.dtype else ref.dtype
        self.state_dtype = compute_dtype(torch.empty(0, dtype=self.dtype))

    def _init_state(self) -> None:
        """Empty state; also rejects ``kernels="triton"`` where Triton cannot run.

        Raises:
            ConfigError: ``kernels="triton"`` on a non-CUDA device without ``TRITON_INTERPRET=1``,
                or with it set only after Triton kernels were defined compiled (specla's or FLA's).
        """
        if self.config.kernels == "triton" and self.device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ConfigError(f"kernels='triton' on {self.device.type} needs TRITON_INTERPRET=1 (Triton's CPU "
                                  "interpreter, for tests), set before Python starts; use kernels='auto' or "
                                  "'reference'")
            if compiled_kernels_loaded():
                raise ConfigError(f"kernels='triton' on {self.device.type}: TRITON_INTERPRET=1 was set after "
                                  "Triton kernels (specla's or FLA's) were loaded as compiled kernels (Triton "
                                  "decides when a kernel is defined); set it before Python starts")
        self.recurrent: list[Tensor] = []
        self.conv: list[Tensor | None] = []
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_hidden = torch.zeros(0, self.embed_weight.shape[1], dtype=self.dtype, device=self.device)
        self.pending: PendingCommit | None = None
        self._prefill_graphs: dict[int, _PrefillGraph] = {}  # recorded prefill passes per batch size

    @abstractmethod
    def _empty_state(self, B: int) -> None:
        """Set ``recurrent`` and ``conv`` to zero states for ``B`` sequences."""

    @abstractmethod
    def forward(self, tokens: Tensor, parents: Tensor, counts: Tensor, records: str, logits: bool = True,
                pending: PendingCommit | None = None):
        """Run the model over ``[B, T]`` trees hanging from the committed state (``parents``
        ``-1`` = child of the state, ``counts [B]`` real nodes), applying ``pending`` first.
        Returns ``(logits [B, T, vocab] or None, hidden [B, T, hidden], records tuple)``."""

    @abstractmethod
    def _empty_records(self, B: int, T: int) -> tuple[Record, ...]:
        """Every layer's ``factor`` record of a ``T``-row pass, zeroed, laid out as
        :meth:`forward` returns them (see :meth:`specla.mixers.Mixer.empty_record`)."""

    @abstractmethod
    def _apply(self, records: tuple[Record, ...], path: Tensor, path_len: Tensor) -> None:
        """Commit ``path`` (``[B, P]``, ``path_len [B]``) to every layer from its records."""

    @property
    def triton_kernels(self) -> bool:
        """Whether the plugin's Triton kernels may run: ``SpecConfig.kernels`` is ``triton``, or
        ``auto`` on a CUDA device."""
        return self.config.kernels == "triton" or (self.config.kernels == "auto" and self.device.type == "cuda")

    def _use_kernel(self, records: str) -> bool:
        """Whether this pass runs the plugin's Triton kernels: they may run here, the records are
        factor records, the state is float32 and no gradient is needed (the kernels have none)."""
        return (self.triton_kernels and records == "factor" and self.state_dtype == torch.float32
                and not self.differentiable)

    # ------------------------------------------------------------------ CUDA graphs
    graph_kernel_nodes = 63
    """The largest draft budget ``N`` whose verify a CUDA graph can record with the Triton
    kernels: the parallel kernel (the one launch that needs nothing from the host) holds trees of
    up to 64 nodes, the root included. Plugins with another limit override it."""

    def _kernel_choice(self, pick, parents: Tensor, counts: Tensor) -> str:
        """The verify kernel of this pass: the plugin's rule ``pick(parents, counts,
        config.verify_kernel)`` (it may read the tree on the host), or, while a CUDA graph is
        recorded (``static_shapes``), a kernel whose launch reads nothing on the host: ``serial``
        for one-token passes (plain decoding: a chain of one; far faster than the parallel
        kernel there, docs/tuning.md, "One-token passes in a recorded step"), else
        ``parallel``; ``graph_kernel_nodes`` keeps recorded trees within its size."""
        if self.static_shapes:
            return "serial" if parents.shape[1] == 1 else "parallel"
        return pick(parents, counts, self.config.verify_kernel)

    def graph_max_nodes(self) -> int:
        """See :meth:`TargetAdapter.graph_max_nodes`: ``graph_kernel_nodes`` on the Triton path
        (with float32 state and factor records), unbounded on the PyTorch reference path."""
        return self.graph_kernel_nodes if self._use_kernel(self.config.commit) else 1024

    def _state_list(self) -> list[Tensor]:
        """The recurrent states (every layer), then the conv windows (the layers that have one)."""
        return [*self.recurrent, *(c for c in self.conv if c is not None)]

    def _set_state_list(self, tensors: Iterable[Tensor]) -> None:
        """Rebind the states to the first tensors of ``tensors`` (the layout of
        :meth:`_state_list`); an iterator is left at the first tensor not taken."""
        it = iter(tensors)
        self.recurrent = [next(it) for _ in self.recurrent]
        self.conv = [None if c is None else next(it) for c in self.conv]

    def graph_state(self) -> list[Tensor] | None:
        """``recurrent`` (every layer), ``conv`` (the layers that have one), ``roots``, then, with
        the ``factor`` commit, the pending commit's record fields layer by layer, ``path`` and
        ``path_len``. ``None`` while a ``factor`` run has no pending commit yet (before its first
        step): its record shapes are not known."""
        out = [*self._state_list(), self._roots]
        if self.config.commit == "factor":
            if self.pending is None:
                return None
            self._pending_template = self.pending
            for rec in self.pending.records:
                out += rec.tensors()
            out += [self.pending.path, self.pending.path_len]
        return out

    def empty_commit(self, nodes: int, depth: int) -> None:
        """See :meth:`TargetAdapter.empty_commit`: with the ``factor`` commit and nothing
        pending, ``PendingCommit(records of nodes + 1 rows zeroed (:meth:`_empty_records`), path
        [B, depth + 1] of -1, path_len 0)``."""
        if self.config.commit != "factor" or self.pending is not None:
            return
        B, dev = self.batch_size, self.device
        self.pending = PendingCommit(self._empty_records(B, nodes + 1),
                                     torch.full((B, depth + 1), -1, dtype=torch.int64, device=dev),
                                     torch.zeros(B, dtype=torch.int64, device=dev))

    def set_graph_state(self, tensors: list[Tensor]) -> None:
        """Rebind the state to ``tensors`` (the layout of :meth:`graph_state`)."""
        it = iter(tensors)
        self._set_state_list(it)
        self._roots = next(it)
        if self.config.commit == "factor":
            records = tuple(
                replace(r, **{f.name: next(it) for f in fields(r) if isinstance(getattr(r, f.name), Tensor)})
                for r in self._pending_template.records)
            self.pending = PendingCommit(records, next(it), next(it))
            self._pending_template = self.pending  # the template holds the bound tensors, nothing older

    @property
    def batch_size(self) -> int:
        return self._roots.shape[0]

    @property
    def roots(self) -> Tensor:
        return self._roots

    @torch.no_grad()
    def flush(self) -> None:
        if self.pending is not None:
            self._apply(self.pending.records, self.pending.path, self.pending.path_len)
            self.pending = None

    def recurrent_states(self) -> list[Tensor]:
        self.flush()
        return list(self.recurrent)

    def select(self, index: Tensor) -> None:
        index = index.to(self.device)
        self.recurrent = [s.index_select(0, index) for s in self.recurrent]
        self.conv = [c.index_select(0, index) if c is not None else None for c in self.conv]
        self._roots = self._roots.index_select(0, index)
        self.last_hidden = self.last_hidden.index_select(0, index)
        if self.pending is not None:
            self.pending = self.pending.select(index)

    embed_scale = 1.0
    """The factor a model multiplies its input embeddings by (Falcon-H1's ``embedding_multiplier``;
    1 for most models)."""

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
        """Logits ``[..., vocab]`` of last-layer features ``[..., hidden]`` (final norm + LM head).
        Where the plugin's kernels run and no gradient is taken, the norm is one Triton launch
        (:func:`specla.ops.norm_triton.rms_norm`, same formula and roundings): a drafter scores
        every draft level with it inside the recorded step."""
        if self.triton_kernels and not (torch.is_grad_enabled() and hidden.requires_grad):
            from .ops import norm_triton  # on first use: TRITON_INTERPRET is read when kernels are defined

            return norm_triton.rms_norm(hidden, self.norm, self.norm_eps) @ self.lm_head.T
        return rms_norm(hidden, self.norm, self.norm_eps) @ self.lm_head.T

    def score(self, tokens: Tensor, return_hidden: bool = False):
        """Teacher-forced logits of whole sequences from an empty state (chunked chains; a plugin
        may override it with a whole-sequence form, as GDN does).

        Args:
            tokens: ``[B, T]`` int64, ``T >= 1``.
            return_hidden: also return the last-layer features ``[B, T, hidden]``.
        Returns:
            ``[B, T, vocab]`` logits in the activation dtype (and the features).
        Discards any batch the adapter held.
        """
        self.pending = None
        self._empty_state(tokens.shape[0])
        self._roots = torch.zeros(tokens.shape[0], dtype=torch.int64, device=self.device)
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.int64, device=self.device)
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            logits, hidden = self._run_chunks(tokens.to(self.device), lengths, logits=True)
        return (logits, hidden) if return_hidden else logits

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
            self._apply(recs, torch.where(tree.valid, torch.arange(W, device=self.device), -1), n)
        return (torch.cat(outs, 1) if logits else None), torch.cat(feats, 1)

    @torch.no_grad()
    def _prefill(self, prompts: list[list[int]]) -> None:
        self.pending, self.prompt_hidden = None, None
        self._empty_state(len(prompts))
        bodies = [p[:-1] for p in prompts]
        T = max(len(b) for b in bodies)
        self.last_hidden = torch.zeros(len(prompts), self.embed_weight.shape[1], dtype=self.dtype, device=self.device)
        self.prefill_form = ""  # one-token prompts: nothing runs
        B = len(prompts)
        # one upload that does not stall the host (upload_ints): roots, lengths, then the tokens
        up = upload_ints([p[-1] for p in prompts] + [len(b) for b in bodies]
                         + [t for b in bodies for t in b + [0] * (T - len(b))], self.device)
        roots = up[:B]
        if T:
            lengths, tokens = up[B : 2 * B], up[2 * B :].view(B, T)
            mode = self._prefill_mode(len(prompts))
            self.prefill_form = ("chunked" if mode == "whole" else
                                 "passes" if mode is not None and self._chunk_passes() else "chain")
            if mode == "whole":
                hidden = self._run_whole(tokens, lengths)
            elif mode is None:
                _, hidden = self._run_chunks(tokens, lengths)
            else:
                hidden = self._run_chunks_static(tokens, lengths, record=mode == "record")
            last = hidden[torch.arange(len(prompts), device=self.device), (lengths - 1).clamp(min=0)]
            self.last_hidden = torch.where((lengths > 0)[:, None], last, self.last_hidden)
            self.prompt_hidden = hidden
        self._roots = roots

    def _whole_prefill(self) -> bool:
        """Whether prompts run as one pass over whole sequences (``SpecConfig.prefill``
        ``chunked``) rather than as 64-token chains; ``False`` unless a subclass implements
        :meth:`_run_whole`."""
        return False

    def _run_whole(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """The whole-prompt pass (see :meth:`_whole_prefill`): ``tokens [B, T]`` int64
        (right-padded), ``lengths [B]`` int64, from the state the mixers hold (empty after
        ``_empty_state``); returns ``[B, T, hidden]``."""
        raise NotImplementedError

    def _chunk_passes(self) -> bool:
        """Whether the fixed-shape prefill passes run every mixer's chunked whole-sequence
        kernels from the state the previous pass left (``PREFILL_PASS`` tokens each,
        ``SpecConfig.prefill`` ``passes``) rather than a 64-token verify chain and its commit;
        ``False`` unless a subclass has such kernels."""
        return False

    def _prefill_mode(self, B: int) -> str | None:
        """How this prefill runs its passes: ``"whole"`` (one pass over whole prompts,
        :meth:`_whole_prefill`), ``"record"`` (one CUDA graph per batch size,
        replayed per chunk of the prompts: the plugin's kernels on a GPU with ``cuda_graphs`` on
        or auto), ``"unrecorded"`` (the same fixed-shape pass run eagerly: ``cuda_graphs=
        "unrecorded"``, how the CPU tests check it, and :meth:`_chunk_passes` wherever no graph
        is recorded) or ``None`` (eager chain passes of the chunk's own width)."""
        cfg = self.config
        if self._whole_prefill():
            return "whole"
        eager = "unrecorded" if self._chunk_passes() else None
        if B > PREFILL_GRAPH_MAX_BATCH or self.differentiable or self.graph_problem():
            return eager
        if cfg.cuda_graphs == "unrecorded":
            return "unrecorded"
        if cfg.cuda_graphs in ("auto", "on") and self.device.type == "cuda" and self._use_kernel("factor"):
            return "record"
        return eager

    def _prefill_pass(self, g: _PrefillGraph) -> None:
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
                self._apply(recs, torch.where(idx < g.counts[:, None], idx, -1), g.counts)
        finally:
            self.static_shapes = False
        copy_into(g.state + [g.hidden], self._state_list() + [hidden])
        self._set_state_list(g.state)

    def _run_chunks_static(self, tokens: Tensor, lengths: Tensor, record: bool) -> Tensor:
        """:meth:`_run_chunks` (no logits) with fixed-shape passes (``PREFILL_CHUNK`` tokens, or
        ``PREFILL_PASS`` with :meth:`_chunk_passes`) on
        static buffers, recorded once per batch size and replayed per chunk when ``record``
        (see :meth:`_prefill_mode`); the state starts empty. Returns ``[B, T, hidden]``."""
        B, T = tokens.shape
        W = PREFILL_PASS if self._chunk_passes() else PREFILL_CHUNK
        graphs = self._prefill_graphs
        g = graphs.get(B) if record else None
        if g is not None and (g.tokens.shape[1] != W
                              or any(a.shape != b.shape for a, b in zip(g.state, self._state_list()))):
            g = None  # another pass width, or a state sized per run changed (an attention cache grew)
        if g is None:
            g = _PrefillGraph(torch.zeros(B, W, dtype=torch.int64, device=self.device),
                              torch.arange(-1, W - 1, device=self.device).expand(B, W).contiguous(),
                              torch.zeros(B, dtype=torch.int64, device=self.device),
                              [t.clone() for t in self._state_list()],
                              torch.zeros(B, W, self.embed_weight.shape[1], dtype=self.dtype, device=self.device))
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

    @torch.no_grad()
    def _verify(self, tree: DraftTree) -> VerifyOutput:
        pending, self.pending = self.pending, None  # delayed commit: applied inside this pass
        self.prompt_hidden = None  # read by the drafter's reset; not kept through decoding
        tokens = torch.cat([self._roots[:, None], tree.tokens], 1)
        try:
            logits, hidden, recs = self.forward(tokens, tree.parents_with_root, tree.num_nodes + 1, self.config.commit,
                                                pending=pending)
        except SpecError:  # refused before any state moved (Mixer.check): the commit stays pending
            self.pending = pending
            raise
        return VerifyOutput(logits=logits, hidden=hidden, records=recs)

    @torch.no_grad()
    def _commit(self, tree: DraftTree, out: VerifyOutput, acceptance: Acceptance) -> None:
        pending = PendingCommit(out.records, acceptance.path, acceptance.path_len)
        if self.config.commit == "factor":
            self.pending = pending
        else:
            self._apply(pending.records, pending.path, pending.path_len)
        self._roots = acceptance.bonus.to(self.device)
