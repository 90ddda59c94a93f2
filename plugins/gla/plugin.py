"""Registers the Gated Linear Attention plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from specla.config import SpecConfig
from specla.errors import UnsupportedModelError
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin, TargetAdapter

from .naive import FEATURE_MAPS


class GLAPlugin(ArchitecturePlugin):
    """Gated Linear Attention (Yang et al. 2023, arXiv 2312.06635) as implemented by FLA's
    ``GLAForCausalLM`` (``model_type == "gla"``)."""

    name = "gla"
    model_types = ("gla",)

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise UnsupportedModelError(f"{path} is not a checkpoint directory: no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise UnsupportedModelError(f"{cfg_file} is not valid JSON: {err}") from err
        if cfg.get("model_type") not in self.model_types:
            raise UnsupportedModelError(
                f"{path}: model_type {cfg.get('model_type')!r} is not one of {self.model_types}"
            )
        self.check_config(cfg)  # before loading: a hybrid checkpoint would ask for flash-attn
        with warnings.catch_warnings():  # FLA warns that Triton cannot run on a CPU-only machine
            warnings.simplefilter("ignore")
            import fla  # noqa: F401  (registers FLA's classes with transformers' Auto* factories)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto")
        return model.to(device) if device else model

    @staticmethod
    def check_config(cfg: dict) -> None:
        """Raise :class:`UnsupportedModelError` for GLA configurations the plugin cannot run.

        Args: cfg: the model's config as a dict (``config.json`` or ``PretrainedConfig.to_dict()``).
        """
        if cfg.get("attn"):
            raise UnsupportedModelError("GLA models with softmax-attention layers (config.attn) are not supported yet")
        if cfg.get("attnres_block_size") is not None:
            raise UnsupportedModelError("GLA models with attention residuals (attnres_block_size) are not supported")
        if cfg.get("hidden_act", "swish") != "swish":  # FLA's GatedMLP and the output gate both use it
            raise UnsupportedModelError(f"activation {cfg.get('hidden_act')!r} is not supported (swish only)")
        if cfg.get("feature_map") not in FEATURE_MAPS:
            supported = ", ".join(repr(k) for k in FEATURE_MAPS)
            raise UnsupportedModelError(f"feature_map {cfg.get('feature_map')!r} is not supported ({supported})")

    def check_model(self, model: torch.nn.Module) -> None:
        from fla.models import GLAForCausalLM

        if not isinstance(model, GLAForCausalLM):
            raise UnsupportedModelError(f"the gla plugin runs fla.models.GLAForCausalLM, got {type(model).__name__}")
        self.check_config(model.config.to_dict())

    def make_adapter(self, model: torch.nn.Module, config: SpecConfig) -> TargetAdapter:
        self.check_model(model)
        from .adapter import GLAAdapter

        return GLAAdapter(model, config)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [GLAPlugin()]
