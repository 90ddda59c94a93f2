"""Registers the Mamba2 plugin through the ``specla.plugins`` entry-point group."""

from __future__ import annotations

from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.fla_attention import fla_models
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement


TINY_BASE = dict(hidden_size=16, head_dim=8, state_size=6, n_groups=2, num_hidden_layers=2, vocab_size=41, expand=2,
                 eos_token_id=None, initializer_range=0.1)
# shapes the conformance suite covers: grouped B/C (4 heads, 2 groups); one group with per-channel
# D, gate after the norm, biases and a 3-tap conv; no gated norm with a dt clamp, 2-tap conv
# without bias, residual in model dtype; odd sizes with as many groups as heads
TINY_VARIANTS = {
    "base": {},
    "g1_dhdim": dict(n_groups=1, D_has_hdim=True, norm_before_gate=True, use_bias=True, conv_kernel=3),
    "nonorm_clamp": dict(rmsnorm=False, dt_limit=(0.05, 0.6), conv_kernel=2, use_conv_bias=False,
                         residual_in_fp32=False),
    "odd": dict(hidden_size=10, head_dim=5, state_size=3, n_groups=4, num_hidden_layers=3, vocab_size=37),
}


class Mamba2Plugin(ArchitecturePlugin):
    """Mamba2 (SSD; Dao & Gu 2024, arXiv 2405.21060) as implemented by FLA's ``Mamba2ForCausalLM``
    (``model_type == "mamba2"``; transformers' own ``Mamba2ForCausalLM`` runs on the
    ``mamba2_hybrid`` plugin)."""

    name = "mamba2"
    model_types = ("mamba2",)
    # "cuda_graphs": the recorded step runs token-identical to eager decoding on a GPU
    # (tests/core/test_graphs.py, factor and snapshot commits)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)

    def claims(self, model) -> bool:
        """FLA's ``Mamba2ForCausalLM``, or a checkpoint config with FLA's fields (``dt_limit``,
        ``norm_eps``) rather than transformers' (``time_step_limit``, ``layer_norm_epsilon``);
        transformers' own class is the ``mamba2_hybrid`` plugin's."""
        if isinstance(model, dict):
            return "time_step_limit" not in model and "layer_norm_epsilon" not in model
        return type(model).__module__.startswith("fla.")

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        self.checkpoint_config(path)
        cfg_file = Path(path) / "config.json"
        fla_models()  # FLA installed, or a clear error
        from fla.models import Mamba2Config, Mamba2ForCausalLM  # FLA's, not transformers' same-named ones

        try:  # the config alone, through transformers (it decodes e.g. dt_limit's serialised infinity)
            config = Mamba2Config.from_pretrained(str(path))
        except (ValueError, TypeError) as err:
            raise UnsupportedModelError(f"{cfg_file}: not a valid Mamba2 config: {err}") from err
        self.check_config(config.to_dict())  # before loading any weights
        model = load_pretrained(Mamba2ForCausalLM, path, dtype=dtype)
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
        fla_models()
        from fla.models import Mamba2ForCausalLM

        if not isinstance(model, Mamba2ForCausalLM):
            raise UnsupportedModelError(
                f"the mamba2 plugin runs fla.models.Mamba2ForCausalLM, got {type(model).__module__}.{type(model).__name__}"
                + (" (transformers' Mamba2ForCausalLM runs on the mamba2_hybrid plugin)"
                   if type(model).__module__.startswith("transformers.") else "")
            )
        self.check_config(model.config.to_dict())

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import mamba2_spec

        return mamba2_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                   **overrides) -> torch.nn.Module:
        """A random FLA ``Mamba2ForCausalLM`` of shape ``variant`` (:data:`TINY_VARIANTS`; config
        fields ``overrides`` replaced), built in float32, returned in ``dtype``. FLA initialises
        dt in [1e-3, 0.1], D = 1, unit norms and zero biases; they are spread so that decays
        differ between paths and no weight hides a bug by being 0 or 1.

        Raises:
            KeyError: unknown variant.
        """
        fla_models()  # FLA installed, or a clear error
        from fla.models import Mamba2Config, Mamba2ForCausalLM
        torch.manual_seed(seed)
        cfg = Mamba2Config(**{**TINY_BASE, **TINY_VARIANTS[variant], **overrides})
        model = Mamba2ForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for blk in model.backbone.layers:
                m = blk.mixer
                m.A_log.uniform_(-2.0, 1.0)
                m.dt_bias.normal_(0.0, 1.0)
                m.D.normal_(1.0, 0.5)
                blk.norm.weight.normal_(1.0, 0.2)
                for p in (m.conv1d.bias, m.in_proj.bias, m.out_proj.bias):
                    if p is not None:
                        p.normal_(0.0, 0.3)
                if m.rmsnorm:
                    m.norm.weight.normal_(1.0, 0.2)
            model.backbone.norm_f.weight.normal_(1.0, 0.2)
        return model.to(dtype)

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        from .oracle import naive_greedy_decode

        return naive_greedy_decode(model, prompt, max_new_tokens)


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    """The hook implementation pluggy finds through the entry point."""
    return [Mamba2Plugin()]
