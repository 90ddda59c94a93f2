"""Registers the plugin for transformers' Mamba2 family (Mamba2, Bamba, Granite 4.0-H, Nemotron-H,
Falcon-H1) through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

COMMON = dict(vocab_size=41, eos_token_id=None, pad_token_id=0, bos_token_id=1, tie_word_embeddings=False,
              initializer_range=0.2, max_position_embeddings=512)
MAMBA = dict(mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)
ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
# (model_type, config kwargs): every family, with at least one Mamba2 and one attention layer and
# the multipliers set away from 1 so that a missing one shows
TINY_VARIANTS = {
    "mamba2": ("mamba2", dict(hidden_size=16, num_hidden_layers=2, num_heads=4, head_dim=8, expand=2, state_size=8,
                              n_groups=2, conv_kernel=4, chunk_size=4)),
    "bamba": ("bamba", dict(**ATTN, **MAMBA, intermediate_size=48, num_hidden_layers=3, attn_layer_indices=[1],
                            mamba_d_head="auto")),
    "granite": ("granitemoehybrid", dict(
        **ATTN, **MAMBA, intermediate_size=16, shared_intermediate_size=24, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
        position_embedding_type="rope", embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5,
        attention_multiplier=0.3)),
    "nemotron_h": ("nemotron_h", dict(
        **ATTN, hybrid_override_pattern="M*E-M", head_dim=8, intermediate_size=48, mamba_num_heads=8,
        mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_group=1,
        topk_group=1)),
    "falcon_h1": ("falcon_h1", dict(
        **ATTN, intermediate_size=48, num_hidden_layers=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_head="auto", mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4,
        mamba_rms_norm=True, mamba_norm_before_gate=False, embedding_multiplier=2.0, lm_head_multiplier=0.5,
        mlp_multipliers=[0.7, 1.3], key_multiplier=0.9, attention_in_multiplier=1.1, attention_out_multiplier=0.8,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.6, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9])),
}
CLASSES = {"mamba2": "Mamba2", "bamba": "Bamba", "granitemoehybrid": "GraniteMoeHybrid", "nemotron_h": "NemotronH",
           "falcon_h1": "FalconH1"}


class Mamba2HybridPlugin(ArchitecturePlugin):
    """transformers' Mamba2 family (Dao & Gu 2024, arXiv 2405.21060, and its hybrids with softmax
    attention): ``Mamba2ForCausalLM``, ``BambaForCausalLM``, ``GraniteMoeHybridForCausalLM``
    (Granite 4.0-H), ``NemotronHForCausalLM`` and ``FalconH1ForCausalLM``, detected from
    ``model_type``, loaded models or checkpoint directories, run unchanged
    (:func:`specla_mamba2_hybrid.spec.mamba2_hybrid_spec`)."""

    name = "mamba2_hybrid"
    model_types = tuple(CLASSES)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)
    # transformers' norms and its attention compute in float32 inside a float64 run
    logits_tolerance = 1e-6
    model_drafters = ("mtp",)

    def claims(self, model) -> bool:
        """transformers' classes, or a ``mamba2`` checkpoint config with transformers' fields
        (FLA's ``Mamba2ForCausalLM`` shares the model type and is the ``mamba2`` plugin's)."""
        if isinstance(model, dict):
            return model.get("model_type") != "mamba2" or "time_step_limit" in model or "layer_norm_epsilon" in model
        return type(model).__module__.startswith("transformers.")

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg = self.checkpoint_config(path)
        if not self.claims(cfg):
            raise UnsupportedModelError(f"{path}: an FLA Mamba2 checkpoint (dt_limit, norm_eps); run it with the "
                                        "mamba2 plugin")
        import transformers

        # the class by name: FLA registers its own Mamba2ForCausalLM with transformers' Auto classes
        cls = getattr(transformers, f"{CLASSES[cfg['model_type']]}ForCausalLM")
        model = load_pretrained(cls, path, dtype=dtype)
        self.check_model(model)
        return model.to(device) if device else model

    def check_model(self, model: torch.nn.Module) -> None:
        import transformers

        self.require_class(model, tuple(getattr(transformers, f"{c}ForCausalLM") for c in CLASSES.values()),
                           "transformers' ")
        from .spec import _inner, layer_mixers

        for layer in _inner(model).layers:
            for m in layer_mixers(layer):
                if hasattr(m, "A_log") and m.activation not in ("silu", "swish"):
                    raise UnsupportedModelError(f"Mamba2 conv activation {m.activation!r} is not supported (silu only)")
                if hasattr(m, "q_proj") and getattr(m, "sliding_window", None):
                    raise UnsupportedModelError("sliding-window attention layers are not supported by this plugin")

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import mamba2_hybrid_spec

        return mamba2_hybrid_spec(model, placement)

    def make_model_drafter(self, name: str, model: torch.nn.Module):
        """``"mtp"``: :class:`specla.drafters.mtp.MTPDrafter` over the MTP module of the
        Nemotron-H checkpoint the model was loaded from. Raises DrafterError for other families
        and checkpoints without one (see :func:`specla_mamba2_hybrid.mtp.mtp_drafter`)."""
        if name != "mtp":
            raise NotImplementedError(f"the mamba2_hybrid plugin's model drafters are {self.model_drafters}, "
                                      f"not {name!r}")
        from .mtp import mtp_drafter

        return mtp_drafter(model)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random model of family ``variant`` (:data:`TINY_VARIANTS`) with decays, step sizes,
        skips and norm weights spread so that paths differ and no weight hides a bug by being 0 or
        1; MoE experts on transformers' eager implementation (its grouped GEMM takes no float64).

        Raises:
            KeyError: unknown variant.
        """
        import transformers

        mt, kw = TINY_VARIANTS[variant]
        name = CLASSES[mt]
        torch.manual_seed(seed)
        cfg = getattr(transformers, f"{name}Config")(**{**COMMON, **kw})
        if hasattr(cfg, "num_local_experts") or hasattr(cfg, "n_routed_experts"):
            cfg._experts_implementation = "eager"
        model = getattr(transformers, f"{name}ForCausalLM")(cfg).to(dtype).eval()
        from specla.testing.transformers_oracle import spread_parameters

        return spread_parameters(model)

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy decoding (no-cache forwards on its PyTorch path)."""
        from specla.testing.transformers_oracle import transformers_greedy

        return transformers_greedy(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [Mamba2HybridPlugin()]
