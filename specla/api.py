"""Public entry points: :func:`run` and the reusable :class:`SpecDecoder`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import SpecConfig
from .drafters import make_drafter
from .engine import Engine, RunStats
from .errors import ConfigError, InvalidTokenError, UnsupportedModelError
from .interfaces import ArchitecturePlugin, Drafter
from .registry import detect_plugin, get_plugin

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
        return SpecConfig.model_validate(config)
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
        plugin: architecture plugin name (``"gdn"``), or ``None`` to detect it from
            ``config.model_type``.
        drafter: ``"ngram"``, a drafter directory written by ``specla train-drafter``, or a
            :class:`~specla.interfaces.Drafter` instance.
        config: a :class:`SpecConfig` or a dict of its fields.
        tokenizer: a transformers tokenizer, a tokenizer directory, or ``None`` (a checkpoint
            directory's own tokenizer is used when it has one).

    The model's weights are read (and converted to the run's device and dtype) here, once: edit
    weights before building a decoder, not after.

    Raises:
        UnknownPluginError: unknown plugin or drafter name (lists the available ones).
        UnsupportedModelError: the plugin cannot run the model (or none matches it), or a path
            is not a checkpoint directory.
        FileNotFoundError: a tokenizer directory that does not exist.
        pydantic.ValidationError: invalid config fields (e.g. ``temperature < 0``).
        ConfigError: ``cuda_graphs="on"`` for a plugin without the ``cuda_graphs`` capability,
            or a configuration graphs cannot run (sampling, a budget over the recorded verify's).
    """

    def __init__(
        self,
        model: ModelLike,
        plugin: str | None = "gdn",
        *,
        drafter: str | Drafter = "ngram",
        config: SpecConfig | dict[str, Any] | None = None,
        tokenizer: Any = None,
    ):
        self.config = _as_config(config)
        if isinstance(model, (str, Path)) and not (Path(model) / "config.json").is_file():
            raise UnsupportedModelError(f"{model} is not a checkpoint directory (no config.json in it)")
        self.plugin: ArchitecturePlugin = get_plugin(plugin) if plugin is not None else detect_plugin(model)
        if isinstance(model, (str, Path)):
            path = Path(model)
            if tokenizer is None and (path / "tokenizer.json").is_file():
                tokenizer = path
            dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
            model = self.plugin.load_model(path, dtype=dtype, device=self.config.device)
        if isinstance(tokenizer, (str, Path)):
            if not Path(tokenizer).is_dir():
                raise FileNotFoundError(f"tokenizer directory {tokenizer} does not exist")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.model = model
        self.tokenizer = tokenizer
        self.config = _cpu_float32(self.config, model)
        if "cuda_graphs" not in self.plugin.capabilities:  # the plugin does not promise graph-safe steps
            if self.config.cuda_graphs == "on":
                raise ConfigError(f"cuda_graphs='on': plugin {self.plugin.name!r} does not declare the "
                                  "'cuda_graphs' capability")
            self.config = self.config.model_copy(update={"cuda_graphs": "off"})
        self.adapter = self.plugin.make_adapter(model, self.config)
        self.drafter = make_drafter(drafter)
        self.drafter.bind(self.adapter)
        self.engine = Engine(self.adapter, self.drafter, self.config)  # kept: its CUDA graphs are reused

    def encode(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids of each prompt.

        Raises:
            TypeError: ``prompts`` is not a list of strings or a list of token-id lists.
            ValueError: string prompts without a tokenizer.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        if not prompts:
            raise InvalidTokenError("no prompts given")
        if all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= or token-id lists")
            return [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        rows = [p.tolist() if hasattr(p, "tolist") else p for p in prompts]  # tensors, numpy arrays
        if all(isinstance(p, (list, tuple)) for p in rows):
            return [list(p) for p in rows]  # ids are checked (not coerced) by the adapter
        raise TypeError("prompts must be all strings or all token-id lists (or 1-D tensors/arrays)")

    def generate(self, prompts: list[str] | list[list[int]]) -> RunResult:
        """Decode ``prompts`` (strings with a tokenizer, or token-id lists) as one batch.

        Raises:
            InvalidTokenError: an empty prompt or an out-of-vocabulary id (state untouched).
        """
        ids = self.encode(prompts)
        outputs, stats = self.engine.generate(ids)
        texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outputs] if self.tokenizer else None
        return RunResult(outputs=outputs, texts=texts, stats=stats)


def run(
    model: ModelLike,
    plugin: str | None = "gdn",
    *,
    prompts: list[str] | list[list[int]],
    drafter: str | Drafter = "ngram",
    config: SpecConfig | dict[str, Any] | None = None,
    tokenizer: Any = None,
) -> RunResult:
    """Greedy speculative decoding of ``prompts`` with ``model``: one-shot form of
    :class:`SpecDecoder` (same arguments and errors). The outputs are token-identical to greedy
    autoregressive decoding of the same model (float32; see docs/DESIGN.md section 7)."""
    return SpecDecoder(model, plugin, drafter=drafter, config=config, tokenizer=tokenizer).generate(prompts)
