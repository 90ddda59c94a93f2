"""The CPU-checkable part of ``benchmarks/kernels.py`` (every study times CUDA graphs): without a
GPU it refuses to start, in one line, instead of failing inside its first study."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_refuses_a_machine_without_a_gpu(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, "kernels.py: error: needs a CUDA GPU; torch sees none\n", "")
    assert not out.exists()
