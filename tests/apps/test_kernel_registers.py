"""``benchmarks/scripts/kernel_registers.py``: the Mamba2 tree kernel compiled for sm_90a on the
CPU and read back from ``ptxas -v``, one JSON line per launch with the tiles the library's launch
picked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "kernel_registers.py"


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell").exists(),
                    reason="Triton's wheel here ships no ptxas-blackwell")
def test_one_line_per_launch_with_the_tiles_the_launch_picked():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "tiny-mamba2", "--tp", "1", "--batches", "1,2",
                           "--trees", "8", "--tuning", '{"programs": 1}'], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    # tiny-mamba2: P = NS = 16, so the tiles are 16 wide whatever the settings; trees of 8 in 32-node tiles
    tiles = [(r["batch"], r["BT"], r["BN"], r["BP"], r["num_warps"]) for r in rows]
    assert tiles == [(1, 32, 16, 16, 4), (2, 32, 16, 16, 4)]
    assert all(0 < r["regs"] <= 255 and r["spill_stores"] >= 0 and r["shared"] > 0 for r in rows)
