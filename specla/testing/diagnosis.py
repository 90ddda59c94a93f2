"""Where a speculative run first leaves plain decoding: :func:`diagnose`, which the conformance
suite (:mod:`specla.testing.suite`) runs when a token comparison fails.

Plain decoding's state after a sequence's tokens is that of a second adapter of the plugin that
prefilled exactly those tokens from an empty state: prefill runs them as chains, committed
through the mixers alone (never through ``TargetAdapter.commit``), so a commit that moves the
wrong state shows as a state that differs. Every state tensor a mixer holds is compared
(:meth:`specla.mixers.Mixer.state`, named by :meth:`~specla.mixers.Mixer.state_names`: the
recurrent state, the conv window, a KV cache and its length...); an adapter without mixers
exposes its recurrent states alone (:meth:`TargetAdapter.recurrent_states`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..api import SpecDecoder, _as_config
from ..config import SpecConfig
from ..interfaces import ArchitecturePlugin, Drafter, TargetAdapter
from ..registry import get_plugin
from ..tree import DraftTree


@dataclass(frozen=True)
class StateDifference:
    """The first state of one sequence that differs from plain decoding's (:func:`compare_states`).

    Attributes:
        layer: the model layer holding the state.
        state: its kind, as the layer's mixer names it (``'recurrent'``, ``'conv window'``,
            ``'key cache'``...).
        max_abs: ``max |speculative - plain|`` over the state's elements.
        rel: ``max_abs`` over ``max |plain|`` (``inf`` where plain decoding's state is all zeros).
    """

    layer: int
    state: str
    max_abs: float
    rel: float

    def __str__(self) -> str:
        return (f"layer {self.layer} {self.state!r} state differs from plain decoding's by max |d| "
                f"{self.max_abs:.3g} (rel {self.rel:.3g})")


@dataclass(frozen=True)
class Divergence:
    """Where a speculative run first left plain decoding (:func:`diagnose`); ``str()`` is the
    conformance suite's failure message.

    Attributes:
        sequence: the prompt's index in the batch.
        step: the decoding step (from 1) whose commit left plain decoding's state, or ``None``
            when every state matched.
        accepted: the drafts that step committed for the sequence (the bonus token not counted).
        difference: the first state that differs, or ``None``.
        position: the first output position where the sequence's tokens differ from the expected
            ones, or ``None`` when they are equal.
        token, expected: the tokens there (``None``: that output ends before ``position``).
    """

    sequence: int
    step: int | None = None
    accepted: int | None = None
    difference: StateDifference | None = None
    position: int | None = None
    token: int | None = None
    expected: int | None = None

    def __str__(self) -> str:
        if self.position is None:
            tokens = "its tokens equal the expected ones"
        else:
            shown = ["nothing" if t is None else str(t) for t in (self.token, self.expected)]
            tokens = f"first token mismatch at position {self.position}: {shown[0]} != {shown[1]}"
        if self.difference is None:
            return (f"sequence {self.sequence}: every state equals plain decoding's before every verify (the "
                    f"verify's logits or the acceptance differ); {tokens}")
        drafts = "draft" if self.accepted == 1 else "drafts"
        return (f"sequence {self.sequence}, step {self.step} (after committing {self.accepted} accepted {drafts}): "
                f"{self.difference}; {tokens}")


def diagnose(plugin: str | ArchitecturePlugin, model: torch.nn.Module, prompts: list[list[int]],
             expected: list[list[int]] | None = None, *, drafter: str | Drafter = "ngram",
             config: SpecConfig | dict | None = None) -> Divergence | None:
    """Run ``prompts`` again, step by step, and find where speculative decoding first leaves
    plain decoding.

    After every verify (which has applied the previous step's commit, delayed or not) each
    sequence's state is compared with plain decoding's after the same committed tokens (see the
    module docstring), layer by layer in the model's order, until one differs by more than
    :func:`state_tolerance` (relative and absolute, ``torch.allclose``). States sized per batch
    (an attention cache sized for the longest prompt) are compared over the slots both hold.
    Recorded CUDA graphs cannot be watched: ``cuda_graphs="on"`` runs the same fixed-shape step
    unrecorded, ``"auto"`` eagerly. The run uses an adapter and a decoder of its own; nothing of
    the caller's is modified except the drafter instance, which the run resets and binds to its
    adapter.

    Args:
        plugin: a registered plugin, or its name.
        model: the model the failing run decoded.
        prompts: the batch's prompts.
        expected: each prompt's expected output; ``None``: the plugin's ``reference_decode`` for
            ``max_new_tokens`` tokens, cut after the first stop token.
        drafter, config: the failing run's (as :class:`specla.SpecDecoder` takes them).
    Returns:
        The first :class:`Divergence`: the earliest step whose commit left plain decoding's
        state (the lowest sequence among those of that step) with that sequence's first token
        mismatch; else the first sequence whose tokens differ from ``expected``; ``None`` when
        every state and every token matched.
    Raises:
        ValueError: ``expected`` does not hold one list per prompt (before anything runs).
        UnknownPluginError: no plugin of that name; and what :class:`specla.SpecDecoder` and the
        run raise.
    """
    if expected is not None and len(expected) != len(prompts):
        raise ValueError(f"expected holds {len(expected)} outputs for {len(prompts)} prompts")
    arch = get_plugin(plugin) if isinstance(plugin, str) else plugin
    cfg = _as_config(config)
    graphs = {"on": "unrecorded", "auto": "off"}.get(cfg.engine.cuda_graphs, cfg.engine.cuda_graphs)
    dec = SpecDecoder(model, arch.name, drafter=drafter, config=cfg.with_engine(cuda_graphs=graphs))
    plain = arch.make_adapter(model, dec.config.with_engine(cuda_graphs="off"))
    watch = _Watch(dec.adapter, plain, prompts, state_tolerance(arch, dec.adapter.dtype))
    outputs = dec.generate(prompts).outputs
    if expected is None:
        stops = set(dec.config.stop_token_ids) | (set(dec.adapter.eos_token_ids) if dec.config.stop_at_eos else set())
        expected = [_cut(arch.reference_decode(model, p, dec.config.max_new_tokens), stops) for p in prompts]
    mismatches = [_first_mismatch(o, e) for o, e in zip(outputs, expected)]
    if watch.found is not None:
        seq, step, accepted, difference = watch.found
        return Divergence(seq, step, accepted, difference, *(mismatches[seq] or (None, None, None)))
    for seq, mismatch in enumerate(mismatches):
        if mismatch is not None:
            return Divergence(seq, position=mismatch[0], token=mismatch[1], expected=mismatch[2])
    return None


def state_tolerance(plugin: ArchitecturePlugin, dtype: torch.dtype) -> float:
    """How far (relative and absolute) a state may lie from plain decoding's in a run of
    activation dtype ``dtype``: the plugin's ``logits_tolerance``, or the square root of the
    dtype's machine epsilon where that is larger (both orders round the same values differently:
    about 3e-4 in float32, 0.09 in bfloat16)."""
    return max(plugin.logits_tolerance, torch.finfo(dtype).eps ** 0.5)


def compare_states(got: TargetAdapter, want: TargetAdapter, tolerance: float, *, got_row: int = 0,
                   want_row: int = 0) -> StateDifference | None:
    """The first state (in the model's layer order, each layer's states in its mixers' order)
    of row ``got_row`` of ``got`` that differs from that of row ``want_row`` of ``want`` beyond
    ``tolerance`` (relative and absolute, ``torch.allclose``), or ``None``. Both adapters are
    the same plugin's, hold a batch and have no commit pending (``want`` runs one verify of a
    root-only tree when a state differs, to find its layer). Tensors of different sizes (caches
    sized per batch) are compared over the part both hold."""
    for (mixer, name, a), (_, _, b) in zip(named_states(got), named_states(want)):
        a, b = a[got_row], b[want_row]
        both = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))
        a, b = a[both].double(), b[both].double()
        if not torch.allclose(a, b, rtol=tolerance, atol=tolerance):
            d, scale = (a - b).abs().max().item(), b.abs().max().item()
            return StateDifference(_mixer_layers(want)[mixer], name, d, d / scale if scale else math.inf)
    return None


def named_states(adapter: TargetAdapter) -> list[tuple[int, str, Tensor]]:
    """``(mixer index, kind, [B, ...] tensor)`` of every state the adapter holds."""
    mixers = getattr(adapter, "mixers", None)
    if mixers is None:
        return [(i, "recurrent", t) for i, t in enumerate(adapter.recurrent_states())]
    return [(i, name, t) for i, m in enumerate(mixers) for name, t in zip(m.state_names(), m.state())]


def _mixer_layers(adapter: TargetAdapter) -> list[int]:
    """The model layer of each of ``adapter.mixers`` (a hybrid layer holds several, an MLP layer
    none), seen in one verify of a root-only tree (no commit pending: the state is untouched);
    the list's own indices for an adapter without mixers."""
    if getattr(adapter, "mixers", None) is None:
        return list(range(len(adapter.recurrent_states())))
    layers: list[int] = []
    block = adapter._block

    def counting(li, x, mix, kernels):
        def counted(h):
            layers.append(li)
            return mix(h)

        return block(li, x, counted, kernels)

    adapter._block = counting  # this adapter's own instance, for one pass
    try:
        adapter.verify(DraftTree.empty(adapter.batch_size, adapter.device))
    finally:
        del adapter._block
    return layers


class _Watch:
    """Hooks on one adapter instance (a diagnosis's own): follows each sequence's committed
    tokens through ``_commit`` and ``select`` and, after each verify, compares every row's state
    with ``plain``'s after prefilling the same tokens, until one differs (``found``)."""

    def __init__(self, adapter: TargetAdapter, plain: TargetAdapter, prompts: list[list[int]], tolerance: float):
        self.adapter, self.plain, self.tolerance = adapter, plain, tolerance
        self.tokens = [list(p) for p in prompts]  # each sequence's committed tokens
        self.rows: list[int | None] = list(range(len(prompts)))  # each row's sequence (None: a copy)
        self.accepted = [0] * len(prompts)  # each sequence's drafts committed by the last step
        self.step = 0
        self.found: tuple[int, int, int, StateDifference] | None = None
        verify, commit, select = adapter._verify, adapter._commit, adapter.select

        def watched_verify(tree):
            out = verify(tree)
            self.compare()
            return out

        def watched_commit(tree, out, acceptance):
            commit(tree, out, acceptance)
            self.step += 1
            num, drafts, bonus = (x.tolist() for x in (acceptance.num_accepted, acceptance.tokens, acceptance.bonus))
            for row, seq in enumerate(self.rows):
                if seq is not None:
                    self.tokens[seq] += drafts[row][: num[row]] + [bonus[row]]
                    self.accepted[seq] = num[row]

        def watched_select(index):
            select(index)
            rows, seen = [], set()
            for i in index.tolist():  # a row repeated to pad a graph's batch is a dead copy
                seq = self.rows[i]
                rows.append(None if seq in seen else seq)
                seen.add(seq)
            self.rows = rows

        adapter._verify, adapter._commit, adapter.select = watched_verify, watched_commit, watched_select

    def compare(self) -> None:
        """Every live row's state against plain decoding's (after the first step, until a
        difference is found: the lowest sequence of the first step that has one)."""
        if self.step == 0 or self.found is not None:
            return
        live = sorted((seq, row) for row, seq in enumerate(self.rows) if seq is not None)
        self.plain.prefill([self.tokens[seq] for seq, _ in live])
        for j, (seq, row) in enumerate(live):
            difference = compare_states(self.adapter, self.plain, self.tolerance, got_row=row, want_row=j)
            if difference is not None:
                self.found = (seq, self.step, self.accepted[seq], difference)
                return


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:end]


def _first_mismatch(got: list[int], want: list[int]) -> tuple[int, int | None, int | None] | None:
    """``(position, got token, wanted token)`` where the lists first differ (``None`` past an
    end), or ``None`` when they are equal."""
    if got == want:
        return None
    p = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return p, got[p] if p < len(got) else None, want[p] if p < len(want) else None
