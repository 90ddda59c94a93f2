"""Registers the Gated Linear Attention plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specla.errors import UnsupportedModelError
from specla.fla_attention import fla_models, is_fla_attention, spread_attention_biases, without_flash_attn
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

# feature maps FLA's GatedLinearAttention may apply to q and k (config.feature_map), in PyTorch
FEATURE_MAPS = {None: lambda x: x, "relu": F.relu, "sigmoid": torch.sigmoid, "swish": F.silu, "silu": F.silu}

TINY_BASE = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, expand_k=0.5, expand_v=1, vocab_size=61,
                 eos_token_id=None, initializer_range=0.1)
# shapes the tests cover: no conv + fused norm/gate; short conv + grouped kv heads + relu feature
# map; clamp_min, no output gate, unfused norm, expand_v 2; odd sizes, conv width 3, 3 layers, no
# output-norm weight
TINY_VARIANTS = {
    "base": {},
    "conv_gqa": dict(use_short_conv=True, num_heads=4, num_kv_heads=2, expand_k=1, feature_map="relu"),
    "clamp_nogate": dict(use_output_gate=False, clamp_min=-0.2, fuse_norm=False, expand_v=2),
    "odd": dict(hidden_size=20, vocab_size=37, num_hidden_layers=3, use_short_conv=True, conv_size=3,
                fuse_norm=False, elementwise_affine=False),
    # FLA's hybrid config: softmax attention (grouped-query heads, a 4-token sliding window, rotary)
    # at layer 0 of 3
    "attn": dict(num_hidden_layers=3, attn=dict(layers=[0], num_heads=4, num_kv_heads=2, qkv_bias=False,
                                                window_size=4, rope_theta=10000.0)),
}


class GLAPlugin(ArchitecturePlugin):
    """Gated Linear Attention (Yang et al. 2023, arXiv 2312.06635) as implemented by FLA's
    ``GLAForCausalLM`` (``model_type == "gla"``)."""

    name = "gla"
    model_types = ("gla",)
    # "cuda_graphs": the recorded step runs token-identical to eager decoding on a GPU
    # (tests/core/test_graphs.py, factor and snapshot commits)
    capabilities = frozenset({"trees", "cuda_graphs"})
    known_failures: dict[str, str] = {}
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
        """Raise :class:`UnsupportedModelError` for GLA configurations the plugin cannot run.

        Args: cfg: the model's config as a dict (``config.json`` or ``PretrainedConfig.to_dict()``).
        """
        if cfg.get("attnres_block_size") is not None:
            raise UnsupportedModelError("GLA models with attention residuals (attnres_block_size) are not supported")
        if cfg.get("hidden_act", "swish") != "swish":  # FLA's GatedMLP and the output gate both use it
            raise UnsupportedModelError(f"activation {cfg.get('hidden_act')!r} is not supported (swish only)")
        if cfg.get("feature_map") not in FEATURE_MAPS:
            supported = ", ".join(repr(k) for k in FEATURE_MAPS)
            raise UnsupportedModelError(f"feature_map {cfg.get('feature_map')!r} is not supported ({supported})")

    def check_model(self, model: torch.nn.Module) -> None:
        fla_models()
        from fla.models import GLAForCausalLM

        if not isinstance(model, GLAForCausalLM):
            raise UnsupportedModelError(f"the gla plugin runs fla.models.GLAForCausalLM, got {type(model).__name__}")
        self.check_config(model.config.to_dict())

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import gla_spec

        return gla_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random FLA ``GLAForCausalLM`` of shape ``variant`` (:data:`TINY_VARIANTS`) in eval mode
        on the CPU, with decays spread so that paths differ (``logsigmoid(~0) / 16`` barely varies):
        the gate bias is drawn wider and ``gate_logit_normalizer`` set to 4 (FLA's layer, the
        adapter and ``naive.py`` all read it from the layer).

        Raises:
            KeyError: unknown variant.
        """
        fla_models()  # FLA installed, or a clear error
        from fla.models import GLAConfig, GLAForCausalLM
        torch.manual_seed(seed)
        with without_flash_attn():
            model = GLAForCausalLM(GLAConfig(**{**TINY_BASE, **TINY_VARIANTS[variant]})).to(dtype).eval()
        with torch.no_grad():
            for blk in model.model.layers:
                if is_fla_attention(blk.attn):  # a hybrid's attention
                    spread_attention_biases(blk.attn)
                else:
                    blk.attn.gk_proj[1].bias.normal_(0.0, 3.0)
                    blk.attn.gate_logit_normalizer = 4
        return model

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy decoding one token at a time with :class:`specla_gla.oracle.NaiveGLA`."""
        from .oracle import naive_greedy_decode

        return naive_greedy_decode(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [GLAPlugin()]
