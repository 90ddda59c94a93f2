"""Registers the Gated DeltaNet plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specla.config import SpecConfig
from specla.errors import UnsupportedModelError
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin, TargetAdapter


class GDNPlugin(ArchitecturePlugin):
    """Gated DeltaNet (Yang et al. 2024, arXiv 2412.06464) as implemented by FLA's
    ``GatedDeltaNetForCausalLM`` (``model_type == "gated_deltanet"``)."""

    name = "gdn"
    model_types = ("gated_deltanet",)

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise UnsupportedModelError(f"{path} is not a checkpoint directory: no config.json")
        model_type = json.loads(cfg_file.read_text()).get("model_type")
        if model_type not in self.model_types:
            raise UnsupportedModelError(f"{path}: model_type {model_type!r} is not one of {self.model_types}")
        import fla  # noqa: F401  (registers FLA's classes with transformers' Auto* factories)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto")
        return model.to(device) if device else model

    def check_model(self, model: torch.nn.Module) -> None:
        from fla.models import GatedDeltaNetForCausalLM

        if not isinstance(model, GatedDeltaNetForCausalLM):
            raise UnsupportedModelError(
                f"the gdn plugin runs fla.models.GatedDeltaNetForCausalLM, got {type(model).__name__}"
            )
        cfg = model.config
        if getattr(cfg, "attn", None):
            raise UnsupportedModelError("GDN models with softmax-attention layers (config.attn) are not supported yet")
        if getattr(cfg, "attnres_block_size", None) is not None:
            raise UnsupportedModelError("GDN models with attention residuals (attnres_block_size) are not supported")
        if cfg.hidden_act not in ("swish", "silu"):
            raise UnsupportedModelError(f"MLP activation {cfg.hidden_act!r} is not supported (swish/silu only)")

    def make_adapter(self, model: torch.nn.Module, config: SpecConfig) -> TargetAdapter:
        self.check_model(model)
        from .adapter import GDNAdapter

        return GDNAdapter(model, config)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [GDNPlugin()]
