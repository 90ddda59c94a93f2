"""Sequence mixers and the one layer loop that runs a stack of them (docs/architecture.md,
"Mixers").

A model is a stack of layers; each layer holds one or more *sequence mixers* (the parts that
carry state from token to token: a recurrent layer with its short-conv window, a softmax-attention
layer with its KV cache) and position-wise modules (norms, MLP or MoE), which act on each verify
row on its own and so need nothing from specla. A :class:`Mixer` declares its state, verifies a
draft tree from it without writing it, returns a record of the pass, and commits an accepted path
from that record. :class:`specla.model.adapter.ModelAdapter` runs a stack of them in one layer
loop (a plugin wires each layer's mixers and position-wise modules in its
:attr:`specla.model.spec.ModelSpec.block`); the op tier (:mod:`specla.mixers.gdn` and its siblings,
:mod:`specla.mixers.attention`) implements them.

Shapes: ``B`` sequences, ``T`` verified nodes with the root explicit (node 0, the last committed
token), ``hidden`` model width.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..ops import kernels
from ..ops.conv import conv_ancestors, conv_window_after, conv_windows_per_node
from ..records import LayerCommit, Record

# prompt tokens per prefill pass (each pass is a chain through the tree path): with the draft
# budget, the widest pass a mixer verifies and commits, which fixed-capacity caches are sized for
PREFILL_CHUNK = 64

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
    commit it is given (its layer's part of the previous step's delayed commit); the record it
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

    def check(self, tp: TreePass, pending: LayerCommit | None) -> None:
        """Raise :class:`SpecError` if this pass cannot run from the current state and its
        ``pending`` commit (the one :meth:`verify` will be given); called for every mixer before
        any of them runs, so that a refused pass leaves every state as it was. Nothing to check
        by default."""

    def select(self, index: Tensor) -> None:
        """Keep the sequences ``index`` (``[B']`` int64, on the state's device)."""
        self.set_state(iter([t.index_select(0, index) for t in self.state()]))

    @abstractmethod
    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        """Apply ``pending`` (this layer's part of the previous step's delayed commit: its record
        and accepted paths, handed as they are to a verify kernel that applies it fused; ``None``
        when nothing is pending), then run the tree ``h`` (``[B, T, hidden]``, the layer's
        normalised input) from the committed state.

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
    may run as several fixed-width passes (``SpecConfig.engine.prefill`` ``passes``); attention layers
    write their cache from slot 0 and do not."""

    prefill_by_default = False
    """Whether the default ``SpecConfig.engine.prefill`` (``auto``) takes the passes when every mixer
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
    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        """Move the state along ``pending.path`` (``[B, P]`` int64 node indices from the root,
        ``-1`` padded; ``pending.path_len [B]``) from ``pending.record``, a record :meth:`verify`
        returned; ``kernels``: the plugin's Triton kernels may run (float32 state, factor
        records)."""

    # ------------------------------------------------------------------ optional: the baselines
    baselines: frozenset[str] = frozenset()
    """The research baselines (``SpecConfig.engine.commit`` ``snapshot``, ``replay``; :mod:`specla.baselines`)
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
