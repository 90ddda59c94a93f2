"""Registers the Gated DeltaNet plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.fla_attention import fla_models, is_fla_attention, spread_attention_biases, without_flash_attn
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement


ASSETS = Path(__file__).resolve().parent / "assets"
# trained by benchmarks/targets/train_target.py --preset tiny (docs/targets.md); the tests' trained
# target. `specla demo` runs its Qwen3.5 form (the qwen plugin's demo target), which needs no FLA.
TINY_TARGET = ASSETS / "tiny"
# trained by `specla train-drafter` on that target (docs/targets.md)
TINY_EAGLE = ASSETS / "tiny-eagle"

TINY_BASE = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, vocab_size=61, expand_v=1,
                 eos_token_id=None, initializer_range=0.1)
# shapes the conformance suite covers: with and without short conv, expand_v 1 and 2, more value
# heads than key heads, no output gate, odd sizes
TINY_VARIANTS = {
    "base": {},
    "expand_v2": dict(expand_v=2),
    "no_conv": dict(use_short_conv=False),
    "gva": dict(num_heads=1, num_v_heads=3),
    "odd_nogate": dict(hidden_size=20, num_heads=3, head_dim=5, vocab_size=37, use_gate=False, num_hidden_layers=3),
    # FLA's hybrid config: softmax attention (grouped-query heads, biases, rotary) at layer 1 of 3
    "attn": dict(num_hidden_layers=3, attn=dict(layers=[1], num_heads=4, num_kv_heads=2, qkv_bias=True,
                                                window_size=None, rope_theta=500.0)),
}


class GDNPlugin(ArchitecturePlugin):
    """Gated DeltaNet (Yang et al. 2024, arXiv 2412.06464) as implemented by FLA's
    ``GatedDeltaNetForCausalLM`` (``model_type == "gated_deltanet"``)."""

    name = "gdn"
    model_types = ("gated_deltanet",)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg = self.checkpoint_config(path)
        self.check_config(cfg)
        fla_models()  # registers FLA's classes with transformers' Auto* factories
        from transformers import AutoModelForCausalLM

        with without_flash_attn():  # a hybrid config's attention layers: specla runs them itself
            model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype)
        return model.to(device) if device else model

    @staticmethod
    def check_config(cfg: dict) -> None:
        """Raise :class:`UnsupportedModelError` for GDN configurations the plugin cannot run.

        Args: cfg: the model's config as a dict (``config.json`` or ``PretrainedConfig.to_dict()``).
        """
        if cfg.get("attnres_block_size") is not None:
            raise UnsupportedModelError("GDN models with attention residuals (attnres_block_size) are not supported")
        if cfg.get("hidden_act", "swish") not in ("swish", "silu"):
            raise UnsupportedModelError(f"MLP activation {cfg.get('hidden_act')!r} is not supported (swish/silu only)")

    def check_model(self, model: torch.nn.Module) -> None:
        fla_models()
        from fla.models import GatedDeltaNetForCausalLM

        if not isinstance(model, GatedDeltaNetForCausalLM):
            raise UnsupportedModelError(
                f"the gdn plugin runs fla.models.GatedDeltaNetForCausalLM, got {type(model).__name__}"
            )
        self.check_config(model.config.to_dict())

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import gdn_spec

        return gdn_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random FLA ``GatedDeltaNetForCausalLM`` of shape ``variant`` (:data:`TINY_VARIANTS`),
        with decays spread so that paths differ (FLA initialises ``A_log`` in ``[0, log 16]``).

        Raises:
            KeyError: unknown variant.
        """
        fla_models()  # FLA installed, or a clear error
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
        torch.manual_seed(seed)
        with without_flash_attn():
            model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**{**TINY_BASE, **TINY_VARIANTS[variant]}))
        model = model.to(dtype).eval()
        with torch.no_grad():
            for blk in model.model.layers:
                if is_fla_attention(blk.attn):  # a hybrid's attention
                    spread_attention_biases(blk.attn)
                else:
                    blk.attn.A_log.uniform_(-2.0, 1.0)
                    blk.attn.dt_bias.normal_(0.0, 1.0)
        return model

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        from .oracle import naive_greedy_decode

        return naive_greedy_decode(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [GDNPlugin()]
