"""Exceptions raised by specla.

Every error a user can trigger with bad input derives from :class:`SpecError`, and also from the
builtin class a caller would naturally catch (``ValueError``, ``LookupError``, ``TypeError``), so
``except ValueError`` keeps working. They are raised before any recurrent state is touched; only
:class:`NonFiniteLogitsError`, which a model raises while decoding, comes later.
"""

from __future__ import annotations


class SpecError(Exception):
    """Base class of every specla error."""


class InvalidTreeError(SpecError, ValueError):
    """A draft tree is malformed: a parent at or after its child, an out-of-range parent, a padding
    node inside the valid prefix, or tensors of the wrong shape, dtype or device."""


class BudgetError(InvalidTreeError):
    """A draft tree holds more nodes, or is deeper, than the configured budget allows."""


class InvalidTokenError(SpecError, ValueError):
    """A token id is negative (a placeholder such as -1 or -100) or not below the vocabulary size,
    or a prompt is empty."""


class TokenTypeError(InvalidTokenError, TypeError):
    """A token id is not an integer (a float, a bool, a string...): prompts are token ids, or
    strings encoded by a tokenizer."""


class UnsupportedModelError(SpecError, TypeError):
    """The model (or checkpoint) is not one the selected plugin can run, or no plugin matches it."""


class UnknownPluginError(SpecError, LookupError):
    """No registered plugin or drafter has the requested name. The message lists the known ones."""


class DrafterError(SpecError, ValueError):
    """A drafter cannot be used: a drafter directory that is incomplete or malformed, or one
    trained for a target of another shape, or training data that yields nothing to train on."""


class NonFiniteLogitsError(SpecError, FloatingPointError):
    """The target's logits for a prompt at a decode step hold NaN or ``+inf``, or are ``-inf`` for
    every token, so no token can be chosen from them (greedy decoding would take whichever id the
    argmax lands on, sampling the last id). The message names the prompts (their indices in the
    call) and the step (``1``: the first after the prefill). That call's outputs are lost; the
    decoder stays usable."""


class ConfigError(SpecError, ValueError):
    """A valid configuration that cannot run on this machine or with this model (e.g.
    ``kernels="triton"`` on a CPU without ``TRITON_INTERPRET=1``, ``cuda_graphs="on"`` without a
    GPU, a stop token outside the model's vocabulary)."""


class PluginLoadWarning(UserWarning):
    """An installed plugin is skipped: its entry point failed to import, or its
    ``specla_architectures`` hook failed or returned something other than
    ``ArchitecturePlugin`` instances, or an architecture name it registers is taken. The message
    names the entry point, its distribution and version, and the error; every other plugin
    keeps working."""


class PluginConflictWarning(UserWarning):
    """A third-party plugin declares a ``model_type`` a built-in plugin runs: it stays usable by
    name (``plugin=``), and auto-detection picks the built-in one."""


class ContextLengthWarning(UserWarning):
    """A run would go past the context the model was trained on (its config's
    ``max_position_embeddings``): recurrent layers decode past it (they keep no positions), but
    the quality of what a model generates there is unknown."""


class ConfigDeprecationWarning(DeprecationWarning):
    """A configuration spelling of the previous release that still works and will be removed in
    the next one (the message gives the new spelling)."""


class GenerationInterrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` (Ctrl-C) stopped a ``generate`` call; it carries what had been
    decoded by then. Being a ``KeyboardInterrupt``, it still ends a program that does not catch it.
    The decoder stays usable: the next call's prefill replaces the state the interrupt left.

    Attributes:
        outputs: the tokens generated per prompt until the interrupt (accepted tokens only:
            under greedy decoding, a prefix of what the whole call returns).
        stats: :class:`~specla.engine.RunStats` of the steps that ran.
        texts: the decoded ``outputs`` (from :meth:`specla.api.SpecDecoder.generate` with a
            tokenizer), else ``None``.
    """

    def __init__(self, outputs: list[list[int]], stats, texts: list[str] | None = None):
        super().__init__(f"generation interrupted after {sum(map(len, outputs))} generated tokens")
        self.outputs, self.stats, self.texts = outputs, stats, texts
