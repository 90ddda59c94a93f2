"""The contract between the engine, drafters and architecture plugins (docs/DESIGN.md section 3).

The core talks to a target model only through :class:`TargetAdapter`, made by an
:class:`ArchitecturePlugin`; it never imports a concrete architecture.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from numbers import Integral
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .config import SpecConfig
from .errors import InvalidTokenError, InvalidTreeError, TokenTypeError, UnsupportedModelError
from .records import Acceptance, Record
from .tree import DraftTree

if TYPE_CHECKING:
    from .model.spec import ModelSpec, Placement


@dataclass(frozen=True)
class VerifyOutput:
    """What one verify pass returns.

    Attributes:
        logits: ``[B, N + 1, vocab]`` target logits (row 0: the root; row ``i + 1``: draft node
            ``i``), each as if that node's root path had been decoded token by token.
        hidden: ``[B, N + 1, hidden]`` last-layer hidden features (before the final norm), for
            feature-level drafters.
        records: one record per layer, of the type the commit strategy needs.
    """

    logits: Tensor
    hidden: Tensor
    records: tuple[Record, ...]


class TargetAdapter(ABC):
    """A target model prepared for speculative decoding of a batch of sequences.

    The adapter owns, per sequence, the recurrent state of every layer (which holds every
    committed token except the last) and the *root*: the last committed token, whose output is
    computed by the next verify. Public methods check their inputs and raise before any state is
    touched; subclasses implement the ``_``-prefixed methods.

    Attributes:
        config: the run's :class:`~specla.config.SpecConfig`.
        vocab_size: number of token ids the embedding accepts.
        eos_token_ids: the model's end-of-sequence tokens (``()``: none); the engine stops a
            sequence at any of them when ``stop_at_eos``. :func:`specla.hf.eos_token_ids`
            reads them from a transformers-style model.
        device, dtype: where and in which activation dtype the model runs.
    """

    config: SpecConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    device: torch.device
    dtype: torch.dtype

    @property
    @abstractmethod
    def batch_size(self) -> int:
        """Number of sequences currently held."""

    @property
    @abstractmethod
    def roots(self) -> Tensor:
        """``[B]`` int64, the last committed token of every sequence."""

    def prefill(self, prompts: list[list[int]]) -> None:
        """Start a new batch: run every prompt but its last token into the state; the last token
        becomes the root. Any previous batch (and pending commit) is discarded.

        Args:
            prompts: ``B`` non-empty lists of token ids.
        Raises:
            InvalidTokenError: an empty prompt, or an id outside ``0..vocab_size-1``.
            TokenTypeError: an id that is not an integer (a float, a bool, a string...).
        """
        if not prompts:
            raise InvalidTokenError("no prompts given")
        for b, p in enumerate(prompts):
            if len(p) == 0:
                raise InvalidTokenError(f"prompt {b} is empty; a prompt needs at least one token")
            for i, t in enumerate(p):
                if isinstance(t, bool) or not isinstance(t, Integral):
                    raise TokenTypeError(f"prompt {b}, position {i}: token ids must be integers, got "
                                         f"{type(t).__name__} {t!r}")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidTokenError(
                    f"prompt {b}: token id {bad[0]!r} is outside the vocabulary 0..{self.vocab_size - 1}"
                )
        self._prefill(prompts)

    def verify(self, tree: DraftTree) -> VerifyOutput:
        """Compute the target's output for every draft node (docs/DESIGN.md section 3, Verify).

        A pending commit is applied first (delayed commit); nothing else touches the state.

        Args:
            tree: ``B`` draft trees on this adapter's device.
        Returns:
            :class:`VerifyOutput`.
        Raises:
            InvalidTreeError: batch size or device mismatch; BudgetError: over ``N`` or ``D``;
            InvalidTokenError: a draft token outside the vocabulary.
        """
        if tree.batch_size != self.batch_size:
            raise InvalidTreeError(f"draft tree batch {tree.batch_size} != adapter batch {self.batch_size}")
        if tree.tokens.device != self.device:
            raise InvalidTreeError(f"draft tree is on {tree.tokens.device}, the model on {self.device}")
        tree.validate(
            vocab_size=self.vocab_size, max_nodes=self.config.num_draft_tokens, max_depth=self.config.max_depth
        )
        return self._verify(tree)

    def commit(self, tree: DraftTree, out: VerifyOutput, acceptance: Acceptance) -> None:
        """Make the accepted path (root plus accepted drafts) part of the state and the bonus
        token the new root, by the configured strategy (``factor`` keeps it pending until the next
        verify or :meth:`flush`).

        Raises:
            ValueError: ``acceptance`` does not match the batch.
        """
        if acceptance.path.shape[0] != self.batch_size:
            raise ValueError(f"acceptance batch {acceptance.path.shape[0]} != adapter batch {self.batch_size}")
        self._commit(tree, out, acceptance)

    last_hidden: Tensor
    """``[B, hidden]`` last-layer feature of the last token prefill ran into the state (zeros for
    one-token prompts): where a feature-level drafter starts."""

    prefill_form: str = ""
    """How the last :meth:`prefill` ran the prompts into the state, for reports
    (:attr:`specla.engine.RunStats.prefill`): ``chain``, ``passes`` or ``chunked`` (the forms of
    ``SpecConfig.engine.prefill``, as run: a form the model or device cannot take falls back to
    ``chain``); empty where the adapter does not say."""

    prompt_hidden: Tensor | None = None
    """``[B, T, hidden]`` last-layer features of every token prefill ran into the state (row ``b``
    valid for its first ``len(prompt_b) - 1`` positions, right-padded), kept from prefill until
    the first verify so a feature-level drafter can read the prompt's context; ``None`` when the
    adapter does not keep them."""

    def embed(self, tokens: Tensor) -> Tensor:
        """Input embeddings ``[..., hidden]`` of ``tokens`` (for feature-level drafters).

        Raises:
            NotImplementedError: the plugin does not expose features.
        """
        raise NotImplementedError(f"{type(self).__name__} does not expose embeddings to drafters")

    def embedding_table(self) -> Tensor | None:
        """The table ``[vocab, hidden]`` whose rows :meth:`embed` returns as they are
        (``embed(tokens) == table[tokens]``), so a drafter can gather embeddings inside its own
        kernels; ``None`` (this default) where ``embed`` computes more (a multiplier) or the
        plugin does not say: call :meth:`embed`."""
        return None

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """Target logits ``[..., vocab]`` of last-layer features ``[..., hidden]``.

        Raises:
            NotImplementedError: the plugin does not expose features.
        """
        raise NotImplementedError(f"{type(self).__name__} does not expose its LM head to drafters")

    @abstractmethod
    def flush(self) -> None:
        """Apply a pending commit now (idempotent; a no-op when nothing is pending)."""

    @abstractmethod
    def recurrent_states(self) -> list[Tensor]:
        """Every layer's recurrent state (``[B, ...]``, after any pending commit is applied):
        what the conformance suite checks for dtype (float32 or float64, never half) and
        finiteness. Read-only views; callers must not modify them."""

    @abstractmethod
    def select(self, index: Tensor) -> None:
        """Keep only the sequences ``index`` (``[B']`` int64), e.g. when others finish."""

    @abstractmethod
    def _prefill(self, prompts: list[list[int]]) -> None: ...

    @abstractmethod
    def _verify(self, tree: DraftTree) -> VerifyOutput: ...

    @abstractmethod
    def _commit(self, tree: DraftTree, out: VerifyOutput, acceptance: Acceptance) -> None: ...


class ArchitecturePlugin(ABC):
    """One architecture (GDN, GLA, Mamba2...), registered through the ``specla.plugins``
    entry-point group by a hook returning an instance (see :mod:`specla.hookspecs`).

    Attributes:
        name: short unique name used as ``plugin=`` (e.g. ``"gdn"``).
        model_types: transformers ``config.model_type`` values this plugin runs (used to
            auto-detect the plugin).
        demo_checkpoint: a small checkpoint directory shipped with the plugin that ``specla demo``
            can run, or ``None``.
        demo_drafters: drafters trained for ``demo_checkpoint``, by name (``specla demo
            --drafter NAME``).
        capabilities: what the plugin supports beyond greedy chain drafts, among ``"trees"``
            (tree drafts), ``"sampling"``, ``"cuda_graphs"`` (steps recorded as CUDA graphs: the
            graph state is :class:`specla.model.adapter.ModelAdapter`'s, so only a plugin whose
            adapter is one declares it); the conformance suite runs the matching tests and
            requires a clear error otherwise.
        known_failures: conformance test names (or one parametrization, ``"test_x[replay]"``)
            expected to fail, with the reason (the suite runs them as strict xfail: an unexpected
            pass fails too).
        tiny_variants: names accepted by :meth:`tiny_model` (model shapes the suite covers).
        model_drafters: drafters the model brings itself, by name (``drafter="mtp"``: the
            multi-token-prediction layer a checkpoint ships), built by :meth:`make_model_drafter`.
        logits_tolerance: the relative and absolute tolerance of the suite's float64 logit
            comparisons between two computation orders (a commit against a fresh prefill):
            ``1e-8`` for models computed in float64 throughout; a model whose own modules round
            to float32 inside a float64 run (transformers' Qwen3.5 norms) declares about ``1e-6``.
    """

    name: str
    model_types: tuple[str, ...]
    demo_checkpoint: Path | None = None
    demo_drafters: dict[str, Path] = {}
    capabilities: frozenset[str] = frozenset()
    known_failures: dict[str, str] = {}
    tiny_variants: tuple[str, ...] = ()
    logits_tolerance: float = 1e-8
    model_drafters: tuple[str, ...] = ()

    def checkpoint_config(self, path: Path) -> dict:
        """``path/config.json`` as a dict, checked to name one of :attr:`model_types`.

        Raises:
            UnsupportedModelError: no ``config.json``, invalid JSON, or another ``model_type``.
        """
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise UnsupportedModelError(f"{path} is not a checkpoint directory: no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise UnsupportedModelError(f"{cfg_file} is not valid JSON: {err}") from err
        if cfg.get("model_type") not in self.model_types:
            raise UnsupportedModelError(f"{path}: model_type {cfg.get('model_type')!r} is not one of {self.model_types}")
        return cfg

    def claims(self, model: "torch.nn.Module | dict") -> bool:
        """Whether this plugin runs ``model`` (a loaded model, or a checkpoint's ``config.json`` as
        a dict) when another plugin declares the same ``model_type``: FLA's and transformers'
        ``Mamba2ForCausalLM`` both say ``"mamba2"``. Auto-detection asks it only then; default
        ``True``."""
        return True

    @abstractmethod
    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        """Load a checkpoint directory (transformers format) into a model object. Plugins of
        transformers model classes load through :func:`specla.hf.load_pretrained`, which refuses
        weights that do not fit the checkpoint's ``config.json``.

        Raises:
            UnsupportedModelError: the checkpoint is not one this plugin runs, or its weights do
                not fit its config (missing, unexpected or of another shape: the message names
                them).
        """

    @abstractmethod
    def check_model(self, model: torch.nn.Module) -> None:
        """Raise :class:`~specla.errors.UnsupportedModelError` naming the reason if this plugin
        cannot run ``model``; return ``None`` otherwise (:meth:`require_class` first, then the
        config's limits)."""

    def require_class(self, model: object, classes: tuple[type, ...], source: str = "", hint: str = "") -> None:
        """Refuse ``model`` unless it is an instance of one of ``classes``, in the words the
        conformance suite checks (``test_models_of_other_plugins_are_refused_by_name``).

        Args:
            source: where the classes come from, written before their names (``"transformers' "``,
                ``"fla.models."``).
            hint: appended to the message (where the refused model would run instead).
        Raises:
            UnsupportedModelError: "the <name> plugin runs <source><Class, ...>, got
                <module>.<Class><hint>".
        """
        if not isinstance(model, classes):
            raise UnsupportedModelError(f"the {self.name} plugin runs {source}{', '.join(c.__name__ for c in classes)}, "
                                        f"got {type(model).__module__}.{type(model).__name__}{hint}")

    def model_spec(self, model: torch.nn.Module, placement: "Placement") -> "ModelSpec":
        """Describe ``model`` as :class:`specla.model.adapter.ModelAdapter` runs it: its mixers,
        block wiring, embeddings and LM head (:class:`specla.model.spec.ModelSpec`). ``model`` is
        already on ``placement.device`` in ``placement.dtype``, in eval mode (a copy where the
        caller's was not; see :attr:`specla.model.spec.Placement.own_copy`).

        Raises:
            NotImplementedError: the plugin writes its own :meth:`make_adapter` instead.
        """
        raise NotImplementedError(f"plugin {self.name!r} describes no model (model_spec)")

    def make_adapter(self, model: torch.nn.Module, config: SpecConfig) -> TargetAdapter:
        """Prepare ``model`` for speculative decoding under ``config``: by default
        :meth:`check_model`, then a :class:`specla.model.adapter.ModelAdapter` built from
        :meth:`model_spec`.

        Raises:
            UnsupportedModelError: see :meth:`check_model`.
            ConfigError: the config cannot run here (``kernels="triton"`` without Triton).
        """
        from .model.adapter import ModelAdapter  # the adapter imports this module

        self.check_model(model)
        return ModelAdapter(model, config, self.model_spec)

    def make_model_drafter(self, name: str, model: torch.nn.Module) -> "Drafter":
        """The drafter ``name`` (one of :attr:`model_drafters`) of ``model``.

        Raises:
            DrafterError: the model does not carry it (e.g. a checkpoint without an MTP layer).
            NotImplementedError: the plugin declares no model drafters.
        """
        raise NotImplementedError(f"plugin {self.name!r} provides no model drafters")

    # -- what the conformance suite (specla.testing) needs from a plugin
    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A tiny randomly initialised model of shape ``variant`` (one of :attr:`tiny_variants`,
        the first being the plainest), in eval mode, on the CPU.

        Raises:
            NotImplementedError: the plugin provides no test models (it cannot run the suite).
        """
        raise NotImplementedError(f"plugin {self.name!r} provides no tiny test models (tiny_model)")

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy autoregressive decoding, one token at a time with the plain sequential
        recurrence (the gdn plugin's ``oracle.py``, for one): the suite's oracle.

        Raises:
            NotImplementedError: the plugin provides no reference decoder.
        """
        raise NotImplementedError(f"plugin {self.name!r} provides no reference decoder (reference_decode)")


class Drafter(ABC):
    """Proposes draft trees from the current contexts.

    Attributes:
        name: short name used as ``drafter=`` in :func:`specla.run`.
    """

    name: str

    def bind(self, adapter: TargetAdapter) -> None:
        """Called once with the target the drafter will serve (default: nothing)."""

    def reset(self, prompts: list[list[int]]) -> None:
        """Called once per batch, after prefill, before the first step (default: nothing)."""

    @abstractmethod
    def propose(self, contexts: list[list[int]], config: SpecConfig) -> DraftTree:
        """Propose one draft tree per sequence.

        Args:
            contexts: per row of the batch, every token so far (prompt and generated); the last
                one is the root the tree hangs from. With CUDA graphs the batch is rounded up to
                a power of two and finished sequences stay in it until half the rows are done:
                such rows show a finished or duplicated context, and their trees are verified
                and discarded (they must still be valid trees).
            config: budget (``num_draft_tokens``, ``max_depth``, ``top_k``, ``tau_tree``).
        Returns:
            a CPU :class:`DraftTree` with ``len(contexts)`` rows within the budget. The engine
            checks it on the host before anything runs (structure, budget, vocabulary), also
            when built with :meth:`DraftTree.trusted`, eagerly and with CUDA graphs alike
            (:func:`specla.step.host_proposal`).
        """

    def on_commit(self, acceptance: Acceptance, out: VerifyOutput) -> None:
        """Called after each commit with the accepted paths and the verify output (default:
        nothing; feature-level drafters follow the accepted path here)."""

    def select(self, index: Tensor) -> None:
        """Keep only the sequences ``index`` (default: nothing to keep)."""

    # -- CUDA graphs (specla.cuda.graph_step): optional
    device_proposals: bool = False
    """Whether :meth:`propose_on_device` builds greedy trees (then a CUDA graph records the
    proposal with the verify pass; else :meth:`propose` runs on the host before each step)."""

    def graph_state(self) -> list[Tensor]:
        """The device tensors a step reads and replaces (e.g. the EAGLE feature), fixed order;
        default: none (a host-side drafter)."""
        return []

    def set_graph_state(self, tensors: list[Tensor]) -> None:
        """Make ``tensors`` (shaped like :meth:`graph_state`'s) the drafter's state."""

    def propose_on_device(self, roots: Tensor, config: SpecConfig) -> DraftTree:
        """The greedy draft tree computed on the target's device with fixed shapes (padded to
        the budget) and no host synchronisation, so that a CUDA graph can record it with the
        verify pass. Only called when :attr:`device_proposals` is true.

        Args:
            roots: ``[B]`` int64, the last committed tokens, on the device.
        Raises:
            NotImplementedError: the drafter proposes on the host only (the default).
        """
        raise NotImplementedError(f"drafter {self.name!r} proposes on the host")
