"""FLA's model classes (``fla.models``): ``GatedDeltaNetForCausalLM``, ``GLAForCausalLM`` and
``Mamba2ForCausalLM``, their hybrid configs' softmax-attention layers included, as the three
architectures ``gdn``, ``gla`` and ``mamba2``.

Each architecture registers through an entry point of its own in the ``specla.plugins`` group,
named as the architecture (:data:`GDN`, :data:`GLA`, :data:`MAMBA2`), as every other plugin does:
``SPECLA_PLUGINS=gdn`` loads that one, and a hook that fails skips only its architecture.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.hf import load_pretrained
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

from .attention import is_fla_attention, spread_attention_biases, without_flash_attn
from .gla import FEATURE_MAPS


ASSETS = Path(__file__).resolve().parent / "assets"
# trained by benchmarks/targets/train_target.py --preset tiny (docs/targets.md); the tests' trained
# target. `specla demo` runs its Qwen3.5 form (the qwen plugin's demo target), which needs no FLA.
TINY_TARGET = ASSETS / "tiny"
# trained by `specla train-drafter` on that target (docs/targets.md)
TINY_EAGLE = ASSETS / "tiny-eagle"


def fla_models():
    """FLA's model classes (the ``fla.models`` module), imported with FLA's import-time warning
    (Triton cannot run on a CPU-only machine) silenced; the import registers them with
    transformers' ``Auto*`` factories.

    FLA is an optional dependency (``pip install 'specla[fla]'``): installed, it makes transformers
    route Qwen3.5's and Qwen3-Next's gated delta rule to FLA's Triton kernels, which do not run on a
    CPU, so only users of FLA's own classes install it.

    Raises:
        UnsupportedModelError: FLA is not installed (or fails to import: the error is named).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("fla.models")
    except ImportError as err:
        raise UnsupportedModelError(f"FLA's model classes need flash-linear-attention, which is not installed "
                                    f"({err}): pip install 'specla[fla]' (from a clone of specla: "
                                    "pip install '.[fla]')") from err


class _FLAPlugin(ArchitecturePlugin):
    """What the three architectures share: the ``fla.models`` class each runs, loaded through
    transformers' ``AutoModelForCausalLM`` (Mamba2's plugin loads its own), and the reference, the
    sequential walker of :mod:`specla_fla.oracle`."""

    fla_class: str  # the name of the fla.models class the plugin runs

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        self.check_config(self.checkpoint_config(path))
        fla_models()  # registers FLA's classes with transformers' Auto* factories
        from transformers import AutoModelForCausalLM

        with without_flash_attn():  # a hybrid config's attention layers: specla runs them itself
            model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype)
        return model.to(device) if device else model

    def check_model(self, model: torch.nn.Module) -> None:
        self.require_class(model, (getattr(fla_models(), self.fla_class),), "fla.models.")
        self.check_config(model.config.to_dict())

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy decoding one token at a time with the model's walker
        (:func:`specla_fla.oracle.naive_greedy_decode`)."""
        from .oracle import naive_greedy_decode

        return naive_greedy_decode(model, prompt, max_new_tokens)


GDN_TINY_BASE = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, vocab_size=61, expand_v=1,
                     eos_token_id=None, initializer_range=0.1)
# shapes the conformance suite covers: with and without short conv, expand_v 1 and 2, more value
# heads than key heads, no output gate, odd sizes
GDN_TINY_VARIANTS = {
    "base": {},
    "expand_v2": dict(expand_v=2),
    "no_conv": dict(use_short_conv=False),
    "gva": dict(num_heads=1, num_v_heads=3),
    "odd_nogate": dict(hidden_size=20, num_heads=3, head_dim=5, vocab_size=37, use_gate=False, num_hidden_layers=3),
    # FLA's hybrid config: softmax attention (grouped-query heads, biases, rotary) at layer 1 of 3
    "attn": dict(num_hidden_layers=3, attn=dict(layers=[1], num_heads=4, num_kv_heads=2, qkv_bias=True,
                                                window_size=None, rope_theta=500.0)),
}


class GDNPlugin(_FLAPlugin):
    """Gated DeltaNet (Yang et al. 2024, arXiv 2412.06464) as implemented by FLA's
    ``GatedDeltaNetForCausalLM`` (``model_type == "gated_deltanet"``)."""

    name = "gdn"
    model_types = ("gated_deltanet",)
    fla_class = "GatedDeltaNetForCausalLM"
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(GDN_TINY_VARIANTS)

    @staticmethod
    def check_config(cfg: dict) -> None:
        """Raise :class:`UnsupportedModelError` for GDN configurations the plugin cannot run.

        Args: cfg: the model's config as a dict (``config.json`` or ``PretrainedConfig.to_dict()``).
        """
        if cfg.get("attnres_block_size") is not None:
            raise UnsupportedModelError("GDN models with attention residuals (attnres_block_size) are not supported")
        if cfg.get("hidden_act", "swish") not in ("swish", "silu"):
            raise UnsupportedModelError(f"MLP activation {cfg.get('hidden_act')!r} is not supported (swish/silu only)")

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .gdn import gdn_spec

        return gdn_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random FLA ``GatedDeltaNetForCausalLM`` of shape ``variant`` (:data:`GDN_TINY_VARIANTS`),
        with decays spread so that paths differ (FLA initialises ``A_log`` in ``[0, log 16]``).

        Raises:
            KeyError: unknown variant.
        """
        fla_models()  # FLA installed, or a clear error
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
        torch.manual_seed(seed)
        with without_flash_attn():
            model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**{**GDN_TINY_BASE, **GDN_TINY_VARIANTS[variant]}))
        model = model.to(dtype).eval()
        with torch.no_grad():
            for blk in model.model.layers:
                if is_fla_attention(blk.attn):  # a hybrid's attention
                    spread_attention_biases(blk.attn)
                else:
                    blk.attn.A_log.uniform_(-2.0, 1.0)
                    blk.attn.dt_bias.normal_(0.0, 1.0)
        return model


GLA_TINY_BASE = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, expand_k=0.5, expand_v=1, vocab_size=61,
                     eos_token_id=None, initializer_range=0.1)
# shapes the tests cover: no conv + fused norm/gate; short conv + grouped kv heads + relu feature
# map; clamp_min, no output gate, unfused norm, expand_v 2; odd sizes, conv width 3, 3 layers, no
# output-norm weight
GLA_TINY_VARIANTS = {
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


class GLAPlugin(_FLAPlugin):
    """Gated Linear Attention (Yang et al. 2023, arXiv 2312.06635) as implemented by FLA's
    ``GLAForCausalLM`` (``model_type == "gla"``)."""

    name = "gla"
    model_types = ("gla",)
    fla_class = "GLAForCausalLM"
    # "cuda_graphs": the recorded step runs token-identical to eager decoding on a GPU
    # (tests/core/test_graphs.py, factor and snapshot commits)
    capabilities = frozenset({"trees", "cuda_graphs"})
    # FLA's GLAConfig has no gate_logit_normalizer: the tiny models' 4 (set on each layer) is not
    # saved, and a reloaded checkpoint runs FLA's 16. tests/plugins/test_gla.py checks the weights'
    # round trip, tests/plugins/test_fla_hybrid.py a checkpoint of a model at FLA's 16
    known_failures: dict[str, str] = {
        "test_a_checkpoint_directory_of_every_variant_runs_unchanged":
            "FLA does not save GLA's gate_logit_normalizer: a reloaded tiny model runs 16, not its 4"}
    tiny_variants = tuple(GLA_TINY_VARIANTS)

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

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .gla import gla_spec

        return gla_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        """A random FLA ``GLAForCausalLM`` of shape ``variant`` (:data:`GLA_TINY_VARIANTS`) in eval mode
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
            model = GLAForCausalLM(GLAConfig(**{**GLA_TINY_BASE, **GLA_TINY_VARIANTS[variant]})).to(dtype).eval()
        with torch.no_grad():
            for blk in model.model.layers:
                if is_fla_attention(blk.attn):  # a hybrid's attention
                    spread_attention_biases(blk.attn)
                else:
                    blk.attn.gk_proj[1].bias.normal_(0.0, 3.0)
                    blk.attn.gate_logit_normalizer = 4
        return model


MAMBA2_TINY_BASE = dict(hidden_size=16, head_dim=8, state_size=6, n_groups=2, num_hidden_layers=2, vocab_size=41,
                        expand=2, eos_token_id=None, initializer_range=0.1)
# shapes the conformance suite covers: grouped B/C (4 heads, 2 groups); one group with per-channel
# D, gate after the norm, biases and a 3-tap conv; no gated norm with a dt clamp, 2-tap conv
# without bias, residual in model dtype; odd sizes with as many groups as heads
MAMBA2_TINY_VARIANTS = {
    "base": {},
    "g1_dhdim": dict(n_groups=1, D_has_hdim=True, norm_before_gate=True, use_bias=True, conv_kernel=3),
    "nonorm_clamp": dict(rmsnorm=False, dt_limit=(0.05, 0.6), conv_kernel=2, use_conv_bias=False,
                         residual_in_fp32=False),
    "odd": dict(hidden_size=10, head_dim=5, state_size=3, n_groups=4, num_hidden_layers=3, vocab_size=37),
}


class Mamba2Plugin(_FLAPlugin):
    """Mamba2 (SSD; Dao & Gu 2024, arXiv 2405.21060) as implemented by FLA's ``Mamba2ForCausalLM``
    (``model_type == "mamba2"``; transformers' own ``Mamba2ForCausalLM`` runs on the
    ``mamba2_hybrid`` plugin)."""

    name = "mamba2"
    model_types = ("mamba2",)
    fla_class = "Mamba2ForCausalLM"
    # "cuda_graphs": the recorded step runs token-identical to eager decoding on a GPU
    # (tests/core/test_graphs.py, factor and snapshot commits)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(MAMBA2_TINY_VARIANTS)

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

        self.require_class(model, (Mamba2ForCausalLM,), "fla.models.",
                           " (transformers' Mamba2ForCausalLM runs on the mamba2_hybrid plugin)"
                           if type(model).__module__.startswith("transformers.") else "")
        self.check_config(model.config.to_dict())

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .mamba2 import mamba2_spec

        return mamba2_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                   **overrides) -> torch.nn.Module:
        """A random FLA ``Mamba2ForCausalLM`` of shape ``variant`` (:data:`MAMBA2_TINY_VARIANTS`; config
        fields ``overrides`` replaced), built in float32, returned in ``dtype``. FLA initialises
        dt in [1e-3, 0.1], D = 1, unit norms and zero biases; they are spread so that decays
        differ between paths and no weight hides a bug by being 0 or 1.

        Raises:
            KeyError: unknown variant.
        """
        fla_models()  # FLA installed, or a clear error
        from fla.models import Mamba2Config, Mamba2ForCausalLM
        torch.manual_seed(seed)
        cfg = Mamba2Config(**{**MAMBA2_TINY_BASE, **MAMBA2_TINY_VARIANTS[variant], **overrides})
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


class _EntryPoint:
    """One architecture as a pluggy plugin of its own, for the entry point named as it."""

    def __init__(self, arch: ArchitecturePlugin):
        self.arch = arch

    @hookimpl
    def specla_architectures(self) -> list[ArchitecturePlugin]:
        return [self.arch]


GDN, GLA, MAMBA2 = _EntryPoint(GDNPlugin()), _EntryPoint(GLAPlugin()), _EntryPoint(Mamba2Plugin())
