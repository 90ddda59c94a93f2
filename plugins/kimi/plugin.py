"""Registers the Kimi Linear plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

TINY_BASE = dict(vocab_size=41, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                 linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                 num_experts_per_token=2, num_expert_group=1, topk_group=1, n_shared_experts=1,
                 model_max_length=512, eos_token_id=None, pad_token_id=0, bos_token_id=1, tie_word_embeddings=False,
                 initializer_range=0.2)
# KDA, MLA, KDA with a MoE layer in the middle; MLA first with a low-rank query and values wider
# than the query-key heads
TINY_VARIANTS = {
    "base": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                 mlp_layer_types=["dense", "sparse", "dense"], q_lora_rank=None),
    "mla_first": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
                      mlp_layer_types=["dense", "dense", "dense"], q_lora_rank=12, v_head_dim=12),
}


class KimiLinearPlugin(ArchitecturePlugin):
    """Moonshot AI's Kimi Linear (KDA and MLA layers, dense and MoE MLPs) as transformers
    implements it, ``KimiLinearForCausalLM``, detected from ``model_type == "kimi_linear"``
    (:func:`specla_kimi.spec.kimi_spec`)."""

    name = "kimi_linear"
    model_types = ("kimi_linear",)
    # "cuda_graphs": the recorded step runs token-identical to transformers' greedy decoding on a
    # GPU (tests/plugins/test_kimi.py)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)
    # transformers' norms and its KDA compute in float32 inside a float64 run
    logits_tolerance = 1e-6

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        self.checkpoint_config(path)
        from transformers import KimiLinearForCausalLM

        model = load_pretrained(KimiLinearForCausalLM, path, dtype=dtype)
        self.check_model(model)
        return model.to(device) if device else model

    def check_model(self, model: torch.nn.Module) -> None:
        from transformers import KimiLinearForCausalLM

        self.require_class(model, (KimiLinearForCausalLM,), "transformers' ")
        for layer in model.model.layers:
            a = layer.self_attn
            if hasattr(a, "kv_b_proj") and a.num_key_value_groups != 1:
                raise UnsupportedModelError("Kimi Linear MLA with num_key_value_heads != num_attention_heads is not "
                                            "supported (its kv_b_proj emits every head)")
            if hasattr(a, "conv1d") and a.activation not in ("silu", "swish"):
                raise UnsupportedModelError(f"KDA short-conv activation {a.activation!r} is not supported (silu only)")

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import kimi_spec

        return kimi_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random ``KimiLinearForCausalLM`` of shape ``variant`` (:data:`TINY_VARIANTS`), decays,
        norm weights and biases spread; MoE experts on transformers' ``batched_mm`` implementation
        (its grouped GEMM takes no float64, its eager one cannot be recorded in a CUDA graph).

        Raises:
            KeyError: unknown variant.
        """
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        from specla.testing.transformers_oracle import spread_parameters

        torch.manual_seed(seed)
        cfg = KimiLinearConfig(**{**TINY_BASE, **TINY_VARIANTS[variant]})
        # transformers' batched experts: the eager ones find the experts hit on the host, which a
        # CUDA graph cannot record (and the fixed-shape step is refused with them)
        cfg._experts_implementation = "batched_mm"
        return spread_parameters(KimiLinearForCausalLM(cfg).to(dtype).eval())

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy decoding (no-cache forwards on its PyTorch path)."""
        from specla.testing.transformers_oracle import transformers_greedy

        return transformers_greedy(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [KimiLinearPlugin()]
