"""Public entry points: :func:`run` and the reusable :class:`SpecDecoder`."""

from __future__ import annotations

import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import torch

from .config import SpecConfig, validation_message
from .drafters import make_drafter, model_drafter_owners
from .engine import Engine, RunStats
from .errors import (ConfigError, ContextLengthWarning, DrafterError, GenerationInterrupted, InvalidTokenError,
                     TokenTypeError, UnsupportedModelError)
from .interfaces import ArchitecturePlugin, Drafter
from .hf import checkpoint_dir, load_tokenizer, tensors_only, tokenizer_dir, weaken_hook_cycles
from .registry import detect_plugin, get_plugin

# transformers' from_pretrained is not thread-safe: two threads loading at once can leave a tied
# weight on the meta device; checkpoints load one at a time
_LOAD_LOCK = threading.Lock()

ModelLike = torch.nn.Module | str | Path


@dataclass
class RunResult:
    """Result of a run.

    Attributes:
        outputs: generated token ids per prompt (new tokens only), in prompt order.
        texts: the decoded outputs when a tokenizer is known, else ``None``.
        stats: :class:`~specla.engine.RunStats` (steps, acceptance, tokens/s, time split).
    """

    outputs: list[list[int]]
    texts: list[str] | None
    stats: RunStats


def _as_config(config: SpecConfig | dict[str, Any] | None) -> SpecConfig:
    if config is None:
        return SpecConfig()
    if isinstance(config, SpecConfig):
        return config
    if isinstance(config, dict):
        try:
            return SpecConfig.model_validate(config)
        except pydantic.ValidationError as err:  # one specla error class for every bad option
            message = validation_message(err)  # a check of the whole config already names it
            raise ConfigError(message if message.startswith("config: ") else f"config: {message}") from err
    raise TypeError(f"config must be a SpecConfig, a dict of its fields or None, got {type(config).__name__}")


def _cpu_float32(config: SpecConfig, model: torch.nn.Module) -> SpecConfig:
    """Half-precision checkpoints run in float32 on the CPU unless a dtype is asked for: CPU
    half-precision matmuls are slower, and their rounding only costs exactness."""
    if config.dtype is not None:
        return config
    param = next(model.parameters(), None)
    device = torch.device(config.device) if config.device else (param.device if param is not None else None)
    if param is not None and device is not None and device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float16):
        return config.model_copy(update={"dtype": "float32"})
    return config


class SpecDecoder:
    """A target, a drafter and a config, prepared once and reused across :meth:`generate` calls
    (weights are converted and plugins resolved only here).

    Args:
        model: a loaded model (e.g. ``fla.models.GatedDeltaNetForCausalLM``) or a checkpoint
            directory in transformers format.
        plugin: architecture plugin name (``"gdn"``), or ``None`` (the default) to detect it
            from the model's ``config.model_type``.
        drafter: ``"ngram"``, a model's own drafter (``"mtp"``), a drafter directory written by
            ``specla train-drafter``, or a :class:`~specla.interfaces.Drafter` instance. A name is
            never read as a path (give a folder ``ngram/`` as ``"./ngram"``); the rule is
            :func:`specla.drafters.make_drafter`'s.
        config: a :class:`SpecConfig` or a dict of its fields.
        tokenizer: a transformers tokenizer, a tokenizer directory, or ``None`` (a checkpoint
            directory's own tokenizer is used when it has one).

    The model's weights are read (and converted to the run's device and dtype) here, once: edit
    weights before building a decoder, not after.

    Raises:
        UnknownPluginError: unknown plugin or drafter name (lists the available ones).
        UnsupportedModelError: the plugin cannot run the model (or none matches it), a path
            that does not exist, is a file or holds no config.json (the messages say which), or
            its files cannot be loaded (a corrupt config.json or weights file: the message names
            the directory and the loader's error, in one line), or its
            weights do not fit its config.json (missing, unexpected or of another shape: the
            message names the directory, the counts and the first few weight names; files holding
            less than half the parameters the config describes are refused before the model is
            built, naming both counts); a model whose weights are on the ``meta`` device (built
            under ``torch.device("meta")`` or loaded with ``device_map="meta"``), refused before
            anything else.
        TypeError: a ``tokenizer`` that is none of the above (not callable, or without ``decode``),
            or a ``drafter`` that is neither a name, a path nor a ``Drafter``.
        FileNotFoundError: a tokenizer directory that does not exist or holds no tokenizer (no
            ``tokenizer.json``, ``vocab.*``, ``*.model`` or ``*.tiktoken`` file: the message names
            the directory and those files), refused before the checkpoint loads.
        ConfigError: invalid config fields given as a dict (e.g. ``temperature < 0``, an unknown
            key: the message names each field and its problem; a ``SpecConfig`` built directly
            raises pydantic's ``ValidationError``).
        ConfigError: ``cuda_graphs="on"`` for a plugin without the ``cuda_graphs`` capability,
            or without a CUDA device, or a configuration graphs cannot run (sampling, a budget
            over the recorded verify's); a ``stop_token_ids`` entry outside the vocabulary.
        DrafterError: a model's own drafter (``"mtp"``) the model does not bring (the plugin has
            none, or the checkpoint ships no fitting MTP layer: the message names the problem); a
            drafter path that is not a trained drafter directory (missing, a file, another
            directory).

    One decoder may be shared between threads: its :meth:`generate` calls run one after another
    (a decoder holds one batch's state), each returning exactly what it would alone.
    """

    def __init__(
        self,
        model: ModelLike,
        plugin: str | None = None,
        *,
        drafter: str | Path | Drafter = "ngram",
        config: SpecConfig | dict[str, Any] | None = None,
        tokenizer: Any = None,
    ):
        self.config = _as_config(config)
        _check_tokenizer(tokenizer)
        if isinstance(model, torch.nn.Module):
            _refuse_meta_weights(model)
        if isinstance(model, (str, Path)):
            model = checkpoint_dir(model)  # "~" expanded
        self.plugin: ArchitecturePlugin = get_plugin(plugin) if plugin is not None else detect_plugin(model)
        own_drafter = isinstance(drafter, str) and drafter in self.plugin.model_drafters  # the model's own (MTP)
        if not own_drafter:  # before any checkpoint loads: a wrong name or directory fails fast
            if isinstance(drafter, str) and (owners := model_drafter_owners(drafter)):
                raise DrafterError(f"drafter={drafter!r} is a model's own drafter, and the {self.plugin.name} "
                                   f"plugin's models bring none (the {', '.join(owners)} plugins' do)")
            self.drafter = make_drafter(drafter)
        if isinstance(tokenizer, (str, Path)):  # before the checkpoint loads, as the drafter
            tokenizer = tokenizer_dir(tokenizer)
        owned = isinstance(model, (str, Path))  # loaded here: nobody else holds it
        if owned:
            path = Path(model)
            if tokenizer is None and (path / "tokenizer.json").is_file():
                tokenizer = path
            dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
            try:
                with _LOAD_LOCK, tensors_only(f"cannot load the checkpoint in {path}: a pickled weights file in it",
                                              UnsupportedModelError,
                                              "convert it to safetensors where it comes from a source you trust"):
                    model = weaken_hook_cycles(self.plugin.load_model(path, dtype=dtype, device=self.config.device))
            except (UnsupportedModelError, ConfigError):
                raise
            except Exception as err:  # transformers, huggingface_hub and safetensors each raise their own
                # in one line, as every specla error: some (transformers' strict config fields) span several
                detail = " ".join(str(err).split())
                raise UnsupportedModelError(f"cannot load the checkpoint in {path}: {type(err).__name__}: "
                                            f"{detail}") from err
        if isinstance(tokenizer, Path):  # after the model, whose type its plugin registers (transformers warns otherwise)
            tokenizer = load_tokenizer(tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        asked = self.config.dtype
        self.config = _cpu_float32(self.config, model)
        if owned and asked is None and self.config.dtype is not None:  # convert once, in place, rather
            model.to(getattr(torch, self.config.dtype))  # than keep a half-precision original beside a copy
        if "cuda_graphs" not in self.plugin.capabilities:  # the plugin does not promise graph-safe steps
            graphs = self.config.engine.cuda_graphs
            if graphs in ("on", "unrecorded"):
                raise ConfigError(f"cuda_graphs={graphs!r}: plugin {self.plugin.name!r} does not declare the "
                                  "'cuda_graphs' capability")
            self.config = self.config.with_engine(cuda_graphs="off")
        self.adapter = self.plugin.make_adapter(model, self.config)
        outside = [t for t in self.config.stop_token_ids if t >= self.adapter.vocab_size]
        if outside:
            raise ConfigError(f"stop_token_ids {outside} are outside the model's vocabulary "
                              f"0..{self.adapter.vocab_size - 1}")
        if own_drafter:
            self.drafter = self.plugin.make_model_drafter(drafter, model)
        self.drafter.bind(self.adapter)
        self.engine = Engine(self.adapter, self.drafter, self.config)  # kept: its CUDA graphs are reused

    def encode(self, prompts: Any) -> list[list[int]]:
        """Token ids of each prompt.

        Args:
            prompts: a list of strings (encoded with the decoder's tokenizer); a list of token-id
                lists (or 1-D tensors / arrays); a ``[B, T]`` integer tensor or array (every row a
                whole prompt); or a tokenizer's output (a mapping with ``input_ids`` ``[B, T]`` and
                optionally ``attention_mask`` ``[B, T]``, whose 0 entries, the padding, are dropped).
        Returns:
            ``B`` lists of ids (their values are checked by the adapter, not coerced).
        Raises:
            TypeError: ``prompts`` is none of the above, or a tensor that is not 2-D.
            TokenTypeError: a tensor or array of non-integer dtype.
            ValueError: string prompts without a tokenizer.
            InvalidTokenError: no prompts; a string prompt that is not valid Unicode text (a lone
                surrogate, as bytes that are not UTF-8 become in ``sys.argv``).
        """
        if isinstance(prompts, Mapping) and "input_ids" in prompts:
            ids, mask = prompts["input_ids"], prompts.get("attention_mask")
            rows = self.encode(ids)
            if mask is not None:
                mask = mask.tolist() if hasattr(mask, "tolist") else mask
                if len(mask) != len(rows) or any(len(m) != len(r) for m, r in zip(mask, rows)):
                    raise TypeError("attention_mask must have the shape of input_ids")
                rows = [[t for t, keep in zip(r, m) if keep] for r, m in zip(rows, mask)]
            return rows
        if hasattr(prompts, "dtype") and hasattr(prompts, "tolist"):  # a torch tensor or numpy array
            if len(prompts.shape) != 2:
                raise TypeError(f"a tensor of prompts must be [B, T] token ids, got shape {tuple(prompts.shape)}")
            if _not_integer_dtype(prompts):
                raise TokenTypeError(f"token ids must be integers, got {_kind(prompts)} of {prompts.dtype}")
            prompts = prompts.tolist()
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of strings, a list of token-id lists or a [B, T] tensor of "
                            f"token ids, got {type(prompts).__name__}")
        if not prompts:
            raise InvalidTokenError("no prompts given")
        if all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= or token-id lists")
            for i, p in enumerate(prompts):
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as err:  # the tokenizers would refuse it with a TypeError
                    raise InvalidTokenError(f"prompt {i} is not valid text: {err}") from None
            return [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        for p in prompts:
            if hasattr(p, "dtype") and _not_integer_dtype(p):
                raise TokenTypeError(f"token ids must be integers, got {_kind(p)} of {p.dtype}")
        rows = [p.tolist() if hasattr(p, "tolist") else p for p in prompts]  # tensors, numpy arrays
        if all(isinstance(p, (list, tuple)) for p in rows):
            # 0-d integer tensors (what indexing a tensor gives) are ids; everything else is checked,
            # not coerced, by the adapter
            return [[t.item() if isinstance(t, torch.Tensor) and t.dim() == 0 and not _not_integer_dtype(t) else t
                     for t in p] for p in rows]
        raise TypeError("prompts must be all strings or all token-id lists (or 1-D tensors/arrays)")

    def warm_up(self, prompts: Any) -> None:
        """Record, before serving, what decoding ``prompts`` as one batch will need: Triton's
        compiled kernels for their shapes and, with CUDA graphs under the adaptive budget policy,
        every candidate budget's graph for this batch size and the smaller graph batches
        (:meth:`specla.engine.Engine.warm_up`), so that no later call records one. Outputs are
        dropped. Arguments and errors as :meth:`generate`; thread-safe."""
        self.engine.warm_up(self.encode(prompts))

    def generate(self, prompts: Any, progress: bool | Callable[[RunStats], None] = False) -> RunResult:
        """Decode ``prompts`` (strings with a tokenizer, or token-id lists) as one batch.

        Args:
            prompts: see :meth:`encode` (lists of ids, strings, a ``[B, T]`` tensor, a
                tokenizer's output).
            progress: ``True`` shows a progress bar of the generated tokens (and tokens/s) on
                stderr; a callable is called after every step with the call's
                :class:`~specla.engine.RunStats` so far (``steps`` and ``generated_tokens``
                current); ``False``: neither.
        Raises:
            InvalidTokenError: an empty prompt or an out-of-vocabulary id (state untouched).
            TokenTypeError: a token id that is not an integer.
            NonFiniteLogitsError: the model's logits for a prompt at a decode step hold NaN or
                +inf, or are -inf for every token (the message names the prompts and the step;
                the decoder stays usable).
            TypeError: ``progress`` neither a bool nor a callable.
            SpecError: ``generate`` called from inside its own ``progress`` callback (the
                running call still holds the decoder; other threads wait their turn instead).
            GenerationInterrupted: a ``KeyboardInterrupt`` (Ctrl-C, or raised by ``progress``)
                during decoding; it carries the outputs (and texts) decoded until then, and the
                decoder stays usable.
        Warns:
            ContextLengthWarning: the longest prompt + ``max_new_tokens`` exceeds the model's
                ``config.max_position_embeddings`` (once per call).
        Thread-safe: concurrent calls run one after another.
        """
        if not (isinstance(progress, bool) or callable(progress)):
            raise TypeError(f"progress must be a bool or a callable, got {type(progress).__name__}")
        ids = self.encode(prompts)
        self._warn_past_context(max(len(p) for p in ids))
        on_step = _TokenBar(len(ids) * self.config.max_new_tokens) if progress is True else progress or None
        try:
            outputs, stats = self.engine.generate(ids, on_step)
        except GenerationInterrupted as interrupted:
            interrupted.texts = self._texts(interrupted.outputs)
            raise
        finally:
            if isinstance(on_step, _TokenBar):
                on_step.bar.close()
        return RunResult(outputs=outputs, texts=self._texts(outputs), stats=stats)

    def _texts(self, outputs: list[list[int]]) -> list[str] | None:
        return [self.tokenizer.decode(o, skip_special_tokens=True) for o in outputs] if self.tokenizer else None

    def _warn_past_context(self, longest: int) -> None:
        config = getattr(self.model, "config", None)
        if hasattr(config, "get_text_config"):  # a multimodal config keeps the language model's apart
            config = config.get_text_config()
        trained = getattr(config, "max_position_embeddings", None)
        if isinstance(trained, int) and longest + self.config.max_new_tokens > trained:
            warnings.warn(f"the longest prompt ({longest} tokens) + max_new_tokens ({self.config.max_new_tokens}) "
                          f"exceeds the model's trained context (max_position_embeddings {trained}): decoding goes on "
                          "past it, but the quality of the tokens beyond it is unknown",
                          ContextLengthWarning, stacklevel=3)


class _TokenBar:
    """A tqdm bar on stderr of the tokens a ``generate`` call has generated, all prompts
    together, moved after every step (tqdm redraws it at most 10 times a second)."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="generate", unit="tok", file=sys.stderr, dynamic_ncols=True, leave=False)

    def __call__(self, stats: RunStats) -> None:
        self.bar.update(stats.generated_tokens - self.bar.n)


def _check_tokenizer(tokenizer: Any) -> None:
    """Refuses a ``tokenizer`` argument specla cannot use, before anything loads: it is called
    on string prompts and its ``decode`` on every output, which would otherwise fail only then
    (after a whole batch is decoded, for token-id prompts).

    Raises:
        TypeError: neither ``None``, a tokenizer directory (``str`` or ``Path``), nor a callable
            with a ``decode`` method (a transformers tokenizer); the message names the type given.
    """
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        return
    if not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError("tokenizer must be a transformers tokenizer, a tokenizer directory or None, "
                        f"got {type(tokenizer).__name__}")


def _refuse_meta_weights(model: torch.nn.Module) -> None:
    """Raises UnsupportedModelError naming a model's tensors on the meta device (shapes without
    data: every read of them fails deep inside the adapter)."""
    tensors = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    meta = [name for name, t in tensors if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (", ..." if len(meta) > 3 else "")
        raise UnsupportedModelError(f"{len(meta)} of the model's {len(tensors)} weights are on the meta device: "
                                    f"load them first ({shown})")


def _kind(x: Any) -> str:
    """How an error names an array of token ids: a torch tensor or a NumPy array."""
    return "a tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__module__.split('.')[0]} array"


def _not_integer_dtype(x: Any) -> bool:
    """Whether a tensor's or array's dtype is not an integer type (bool counts as not)."""
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.bool or x.is_floating_point() or x.is_complex()
    kind = getattr(x.dtype, "kind", "i")  # numpy: 'i'/'u' integers, 'b' bool, 'f' float...
    return kind not in ("i", "u")


def run(
    model: ModelLike,
    plugin: str | None = None,
    *,
    prompts: Any,
    drafter: str | Path | Drafter = "ngram",
    config: SpecConfig | dict[str, Any] | None = None,
    tokenizer: Any = None,
) -> RunResult:
    """Speculative decoding of ``prompts`` with ``model``: one-shot form of :class:`SpecDecoder`
    (same arguments and errors). Greedy outputs are token-identical to greedy autoregressive
    decoding of the same model (float32; see docs/DESIGN.md section 7); with a ``temperature``
    above 0 they are samples of the model's own distribution (lossless sampling)."""
    return SpecDecoder(model, plugin, drafter=drafter, config=config, tokenizer=tokenizer).generate(prompts)
