"""Shared fixtures: tiny random GDN models (the gdn plugin's ``tiny_model``, FLA's own classes).

``TRITON_INTERPRET`` is decided here, before anything imports triton (``@triton.jit`` picks
compiled or interpreted kernels when a kernel is defined): an explicit value in the environment is
kept; otherwise ``1`` (Triton's CPU interpreter) on a machine without CUDA, so that specla's and
FLA's kernels run on the CPU, and ``0`` on a CUDA machine, so that the GPU tests compile them. The
FLA oracle (``tests/fla_oracle.py``) runs either way (:func:`fla_device`); the tests that need FLA's
kernels interpreted on CPU tensors are skipped where they are compiled:
:func:`enable_fla_interpreter` skips the calling test then.
"""

import os


def triton_interpret_default(environ, cuda_available) -> str:
    """The ``TRITON_INTERPRET`` value the tests run under.

    Args:
        environ: the process environment (a mapping).
        cuda_available: a callable answering whether a CUDA device is usable; called only when
            ``environ`` does not set the variable.
    Returns:
        ``environ["TRITON_INTERPRET"]`` when set, else ``"0"`` with CUDA and ``"1"`` without.
    """
    if "TRITON_INTERPRET" in environ:
        return environ["TRITON_INTERPRET"]
    return "0" if cuda_available() else "1"


def _cuda_available() -> bool:
    import torch  # imports no triton: the choice below still decides how kernels are defined

    return torch.cuda.is_available()


os.environ["TRITON_INTERPRET"] = triton_interpret_default(os.environ, _cuda_available)

import random  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402


def worker_threads(environ, cores: int) -> int | None:
    """torch's CPU threads for one test process: ``None`` (torch's default, a thread per core)
    unless pytest-xdist runs several workers and ``OMP_NUM_THREADS`` is not set; then each
    worker's share of the cores. Each worker starting a thread per core oversubscribes the CPU:
    16 workers on a 16-core GPU machine ran the compiled suite's CPU-side tests about 4x slower
    than with one thread each (benchmarks/results/2026-12-06/README.md).

    Args:
        environ: the process environment (a mapping).
        cores: the CPU cores this process may use.
    """
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores // workers)


_threads = worker_threads(os.environ, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count() or 1)
if _threads is not None:
    torch.set_num_threads(_threads)

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")
warnings.filterwarnings("ignore", message=".*ShortConvolution is crucial.*")

from specla.registry import get_plugin  # noqa: E402

from hopper_compile import install as _install_hopper_compile  # noqa: E402

# interpreted kernels are also compiled for sm_90 on their first launch (tests/hopper_compile.py)
_install_hopper_compile()


# Property-based tests draw the same examples on every run, in CI and on a developer's machine
# alike (CI runs the README's command, which sets no CI variable): a seed derived from each test,
# no example database, so a failure reproduces with the same command. ``--hypothesis-seed=N``
# draws other examples.
settings.register_profile("specla-tests", derandomize=True)
settings.load_profile("specla-tests")


# the GDN-layer tests read every layer's GDN state; the hybrid variant ("attn": an FLA attention
# layer among them) has its own tests (test_fla_hybrid.py) and the conformance suite's
MODEL_CONFIGS = tuple(v for v in get_plugin("gdn").tiny_variants if v != "attn")


EVERY_TOKEN = slice(None)  # poison_logits: every token id


def poison_logits(monkeypatch, adapter, step: int, rows: list[int], value: float, tokens=7) -> None:
    """From here on, the adapter's ``step``-th LM head call (counted from 1; with the ngram drafter
    one call per decode step) returns ``value`` for ``tokens`` (an id or :data:`EVERY_TOKEN`) at
    every node of batch ``rows``: the verify pass's own logits, which acceptance reads."""
    calls, lm_logits = [0], adapter.lm_logits

    def poisoned(hidden):
        out = lm_logits(hidden)
        calls[0] += 1
        if calls[0] == step:
            out = out.clone()
            out[rows, :, tokens] = value
        return out

    monkeypatch.setattr(adapter, "lm_logits", poisoned)


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
