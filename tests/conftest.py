"""Shared fixtures: tiny random GDN models built from FLA's own config and model classes.

TRITON_INTERPRET must be set before anything imports triton, so that FLA's Triton kernels (used
as an independent oracle in test_fla_oracle.py) run on the CPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
warnings.filterwarnings("ignore", message=".*ShortConvolution is crucial.*")

from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402

BASE = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, vocab_size=61, expand_v=1, eos_token_id=None,
            initializer_range=0.1)
# several shapes: with and without short conv, expand_v 1 and 2, more value heads than key heads,
# no output gate, odd sizes
MODEL_CONFIGS = {
    "base": {},
    "expand_v2": dict(expand_v=2),
    "no_conv": dict(use_short_conv=False),
    "gva": dict(num_heads=1, num_v_heads=3),
    "odd_nogate": dict(hidden_size=20, num_heads=3, head_dim=5, vocab_size=37, use_gate=False, num_hidden_layers=3),
}


def make_model(name: str = "base", dtype: torch.dtype = torch.float64, seed: int = 0) -> GatedDeltaNetForCausalLM:
    """A random-initialised FLA GatedDeltaNetForCausalLM of shape ``name`` in ``dtype``."""
    torch.manual_seed(seed)
    cfg = GatedDeltaNetConfig(**{**BASE, **MODEL_CONFIGS[name]})
    model = GatedDeltaNetForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # FLA initialises A_log in [0, log 16]; spread decays so paths differ
        for blk in model.model.layers:
            blk.attn.A_log.uniform_(-2.0, 1.0)
            blk.attn.dt_bias.normal_(0.0, 1.0)
    return model


@pytest.fixture(params=list(MODEL_CONFIGS))
def model_name(request):
    return request.param


@pytest.fixture
def rng():
    return random.Random(1234)
