"""Registers the Qwen hybrid plugin (Qwen3.5, Qwen3-Next) through the ``specla.plugins`` entry-point
group."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

TINY_BASE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, eos_token_id=None,
                 initializer_range=0.1)
# shapes the conformance suite covers: the default 3 GDN : 1 attention pattern, more value heads
# than key heads with full rotary, attention first with a sliding interval of 2, and MoE
TINY_VARIANTS = {
    "base": {},
    "gva": dict(linear_num_value_heads=4, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                   partial_rotary_factor=1.0)),
    "attn_first": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "full_attention"],
                       num_key_value_heads=1),
    "moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2),
    # Qwen3-Next: GDN projections grouped per key head, MoE in every layer but the first
    "next": dict(linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                 num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]),
}
MOE_VARIANTS = {"moe": "qwen3_5_moe", "next": "qwen3_next"}
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "qwen3_next")


class QwenPlugin(ArchitecturePlugin):
    """Qwen3-Next (Qwen team, 2025) and Qwen3.5 (2026): Gated DeltaNet layers interleaved with
    gated softmax attention, dense or MoE, as transformers implements them
    (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, and the text
    part of ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``)."""

    name = "qwen"
    model_types = MODEL_TYPES
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)
    # transformers' RMSNorms compute in float32 even in a float64 model: two computation orders
    # of the same logits differ by float32 roundings (about 6e-8 measured on the tiny variants)
    logits_tolerance = 1e-6
    model_drafters = ("mtp",)
    # the trained tiny GDN target (docs/targets.md) in transformers' Qwen3_5ForCausalLM, every layer
    # a GDN layer (benchmarks/targets/gdn_to_qwen3_5.py: the same logits as FLA's model), and the
    # EAGLE drafter trained on it
    demo_checkpoint = Path(__file__).resolve().parent / "assets" / "tiny"
    demo_drafters = {"eagle": Path(__file__).resolve().parent / "assets" / "tiny-eagle"}

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg = self.checkpoint_config(path)
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if cfg["model_type"] in ("qwen3_5", "qwen3_5_moe") else AutoModelForCausalLM
        model = load_pretrained(auto, path, dtype=dtype)
        self.check_model(model)
        from .spec import eager_experts_for_float64

        eager_experts_for_float64(model)
        return model.to(device) if device else model

    def check_model(self, model: torch.nn.Module) -> None:
        from transformers import (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                                  Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM)

        self.require_class(model, (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration,
                                   Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM), "transformers' ")
        from .spec import text_parts

        cfg = text_parts(model)[0].config
        if cfg.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"short-conv activation {cfg.hidden_act!r} is not supported (silu only)")
        unknown = set(cfg.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import qwen_spec

        return qwen_spec(model, placement)

    def make_model_drafter(self, name: str, model: torch.nn.Module):
        """``"mtp"``: :class:`specla.drafters.mtp.MTPDrafter` over the MTP layer of the checkpoint
        the model was loaded from. Raises DrafterError without one (see
        :func:`specla_qwen.mtp.mtp_drafter`)."""
        if name != "mtp":
            raise NotImplementedError(f"the qwen plugin's model drafters are {self.model_drafters}, not {name!r}")
        from .mtp import mtp_drafter

        return mtp_drafter(model)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random ``Qwen3_5ForCausalLM`` (``Qwen3_5MoeForCausalLM`` for ``moe``,
        ``Qwen3NextForCausalLM`` for ``next``) of shape ``variant`` (:data:`TINY_VARIANTS`), with
        decays spread so that paths differ and the zero-initialised norm offsets made random.

        Raises:
            KeyError: unknown variant.
        """
        import transformers as tf

        kw = {**TINY_BASE, **TINY_VARIANTS[variant]}
        cfg_cls, model_cls = {
            None: (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
            "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
            "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        }[MOE_VARIANTS.get(variant)]
        torch.manual_seed(seed)
        model = model_cls(cfg_cls(**kw)).to(dtype).eval()
        if variant in MOE_VARIANTS:  # the default grouped-GEMM experts take no float64
            model.config._experts_implementation = "eager"
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.uniform_(-2.0, 1.0)
                elif name.endswith("dt_bias"):
                    p.normal_(0.0, 1.0)
                elif "norm" in name:  # (1 + w) norms start at w = 0, the gated norm at 1
                    p.add_(torch.randn_like(p) * 0.2)
        return model

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy decoding (no-cache forwards on its PyTorch path)."""
        from specla.testing.transformers_oracle import transformers_greedy

        return transformers_greedy(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [QwenPlugin()]
