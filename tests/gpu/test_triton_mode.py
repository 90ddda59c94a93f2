"""The test run's Triton mode: ``tests/conftest.py`` has Triton's kernels interpreted exactly where
no CUDA device is usable (unless ``TRITON_INTERPRET`` says otherwise), decided before triton is
imported, and the FLA oracle skips where FLA's kernels are compiled; pytest-xdist's workers share
the CPU cores."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_the_test_run_interprets_triton_only_without_cuda():
    import conftest

    never = lambda: pytest.fail("an explicit TRITON_INTERPRET must not probe CUDA")  # noqa: E731
    assert conftest.triton_interpret_default({}, lambda: True) == "0"
    assert conftest.triton_interpret_default({}, lambda: False) == "1"
    assert conftest.triton_interpret_default({"TRITON_INTERPRET": "1"}, never) == "1"
    assert conftest.triton_interpret_default({"TRITON_INTERPRET": "0"}, never) == "0"


def test_xdist_workers_share_the_cores_unless_omp_num_threads_is_set():
    import conftest

    assert conftest.worker_threads({}, 16) is None  # one process: torch's default
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "1"}, 16) is None
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "16"}, 16) == 1
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "4"}, 18) == 4
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "4"}, 2) == 1
    assert conftest.worker_threads({"PYTEST_XDIST_WORKER_COUNT": "4", "OMP_NUM_THREADS": "8"}, 16) is None


@pytest.mark.parametrize("cuda, env, expected", [(True, None, "0"), (False, None, "1"), (True, "1", "1")])
def test_conftest_sets_the_mode_before_triton_is_imported(cuda, env, expected):
    """A fresh interpreter imports tests/conftest.py with CUDA reported (un)available: the mode
    it leaves in the environment, that triton was not imported before, and that a Triton kernel
    defined afterwards is interpreted exactly when the mode is ``1``."""
    code = (
        "import os, sys, torch\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        "before = 'triton' in sys.modules\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import conftest\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "from specla.ops import norm_triton\n"
        "print(os.environ['TRITON_INTERPRET'], before, isinstance(norm_triton._rms_norm_kernel, InterpretedFunction))\n"
    )
    env_vars = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env is not None:
        env_vars["TRITON_INTERPRET"] = env
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == f"{expected} False {expected == '1'}"


def test_the_fla_oracle_skips_where_fla_kernels_are_compiled(monkeypatch):
    import fla_oracle

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(fla_oracle, "_ENABLED", False)  # as in a process that compiled FLA's kernels
    with pytest.raises(pytest.skip.Exception, match="needs FLA's kernels under Triton's CPU interpreter"):
        fla_oracle.enable_fla_interpreter()
