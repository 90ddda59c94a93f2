"""Registers the LFM2 plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

TINY_BASE = dict(vocab_size=41, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                 eos_token_id=None, pad_token_id=0, bos_token_id=1, tie_word_embeddings=False, block_multiple_of=8,
                 max_position_embeddings=512, initializer_range=0.2)
# conv, attention, conv (width 3, no bias); attention first with a biased 4-wide conv and a tied head
TINY_VARIANTS = {
    "base": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
    "attn_first": dict(num_hidden_layers=3, layer_types=["full_attention", "conv", "conv"], conv_L_cache=4,
                       conv_bias=True, tie_word_embeddings=True, num_key_value_heads=1),
}


class Lfm2Plugin(ArchitecturePlugin):
    """Liquid AI's LFM2 (gated short convolutions and grouped-query attention) as transformers
    implements it, ``Lfm2ForCausalLM``, detected from ``model_type == "lfm2"``
    (:func:`specla_lfm2.spec.lfm2_spec`)."""

    name = "lfm2"
    model_types = ("lfm2",)
    # "cuda_graphs": the recorded step runs token-identical to transformers' greedy decoding on a
    # GPU (tests/plugins/test_lfm2.py); its mixers are graph-safe PyTorch ops (tree conv, tree attention)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)
    # transformers' RMSNorms and attention compute in float32 inside a float64 run
    logits_tolerance = 1e-6

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        self.checkpoint_config(path)
        from transformers import Lfm2ForCausalLM

        model = load_pretrained(Lfm2ForCausalLM, path, dtype=dtype)
        return model.to(device) if device else model

    def check_model(self, model: torch.nn.Module) -> None:
        from transformers import Lfm2ForCausalLM

        self.require_class(model, (Lfm2ForCausalLM,), "transformers' ")
        unknown = set(model.config.layer_types) - {"conv", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"LFM2 layer types {sorted(unknown)} are not supported")

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import lfm2_spec

        return lfm2_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random ``Lfm2ForCausalLM`` of shape ``variant`` (:data:`TINY_VARIANTS`), its norm
        weights and biases spread away from 1 and 0.

        Raises:
            KeyError: unknown variant.
        """
        from transformers import Lfm2Config, Lfm2ForCausalLM

        torch.manual_seed(seed)
        model = Lfm2ForCausalLM(Lfm2Config(**{**TINY_BASE, **TINY_VARIANTS[variant]})).to(dtype).eval()
        from specla.testing.transformers_oracle import spread_parameters

        return spread_parameters(model)

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy decoding (no-cache forwards on its PyTorch path)."""
        from specla.testing.transformers_oracle import transformers_greedy

        return transformers_greedy(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [Lfm2Plugin()]
