"""Registers the Mamba2 plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from specla.config import SpecConfig
from specla.errors import UnsupportedModelError
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin, TargetAdapter


class Mamba2Plugin(ArchitecturePlugin):
    """Mamba2 (SSD; Dao & Gu 2024, arXiv 2405.21060) as implemented by FLA's ``Mamba2ForCausalLM``
    (``model_type == "mamba2"``; transformers' own ``Mamba2ForCausalLM`` is not accepted)."""

    name = "mamba2"
    model_types = ("mamba2",)

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise UnsupportedModelError(f"{path} is not a checkpoint directory: no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise UnsupportedModelError(f"{cfg_file} is not valid JSON: {err}") from err
        if cfg.get("model_type") not in self.model_types:
            raise UnsupportedModelError(f"{path}: model_type {cfg.get('model_type')!r} is not one of {self.model_types}")
        with warnings.catch_warnings():  # FLA warns that Triton cannot run on a CPU-only machine
            warnings.simplefilter("ignore")
            from fla.models import Mamba2Config, Mamba2ForCausalLM  # FLA's, not transformers' same-named ones

        try:  # the config alone, through transformers (it decodes e.g. dt_limit's serialised infinity)
            config = Mamba2Config.from_pretrained(str(path))
        except (ValueError, TypeError) as err:
            raise UnsupportedModelError(f"{cfg_file}: not a valid Mamba2 config: {err}") from err
        self.check_config(config.to_dict())  # before loading any weights
        model = Mamba2ForCausalLM.from_pretrained(str(path), dtype=dtype or "auto")
        return model.to(device) if device else model

    @staticmethod
    def check_config(cfg: dict) -> None:
        """Raise :class:`UnsupportedModelError` for Mamba2 configurations the plugin cannot run.

        Args: cfg: the model's config as a dict (``config.json`` or ``PretrainedConfig.to_dict()``).
        """
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"Mamba2 conv/gate activation {act!r} is not supported (silu/swish only)")
        if int(cfg.get("conv_kernel", 4)) < 1:
            raise UnsupportedModelError(f"conv_kernel={cfg.get('conv_kernel')} must be >= 1")
        lo, hi = cfg.get("dt_limit", (0.0, float("inf")))
        if not float(lo) <= float(hi):
            raise UnsupportedModelError(f"dt_limit {cfg.get('dt_limit')} is not a (min, max) pair")

    def check_model(self, model: torch.nn.Module) -> None:
        from fla.models import Mamba2ForCausalLM

        if not isinstance(model, Mamba2ForCausalLM):
            raise UnsupportedModelError(
                f"the mamba2 plugin runs fla.models.Mamba2ForCausalLM, got {type(model).__module__}.{type(model).__name__}"
            )
        self.check_config(model.config.to_dict())

    def make_adapter(self, model: torch.nn.Module, config: SpecConfig) -> TargetAdapter:
        self.check_model(model)
        from .adapter import Mamba2Adapter

        return Mamba2Adapter(model, config)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [Mamba2Plugin()]
