"""Shared fixtures: tiny random GDN models (the gdn plugin's ``tiny_model``, FLA's own classes).

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

from specla.registry import get_plugin  # noqa: E402

MODEL_CONFIGS = get_plugin("gdn").tiny_variants


def make_model(name: str = "base", dtype: torch.dtype = torch.float64, seed: int = 0):
    """A random-initialised FLA GatedDeltaNetForCausalLM of shape ``name`` in ``dtype``
    (the gdn plugin's conformance test models)."""
    return get_plugin("gdn").tiny_model(name, seed=seed, dtype=dtype)


@pytest.fixture(params=list(MODEL_CONFIGS))
def model_name(request):
    return request.param


@pytest.fixture
def rng():
    return random.Random(1234)
