"""Registers and spills of the Mamba2 tree verify kernel at a serving engine's per-rank shapes,
read on the CPU: each launch of ``mamba2_pool_verify`` (run under Triton's interpreter on random
inputs) is compiled for a Hopper GPU (``sm_90a``) and assembled by the ``ptxas`` that ships with
Triton, whose ``-v`` report gives the registers a thread uses, the bytes it spills to local
memory and the shared memory. A proxy for the kernel's speed, not a timing: spills to local
memory cost memory traffic, and a launch that settles on few registers with kilobytes of spills
is the first suspect of a slow cell. The Triton that compiles here is this machine's, which may
generate other code than a GPU machine's.

    python benchmarks/scripts/kernel_registers.py [--models nemotron-h-8b,nemotron-h-56b] [--tp 4]
        [--batches 1,8] [--trees 8,64] [--tuning '{"BN_split": 128}'] > registers.jsonl

``--tuning`` updates ``specla.mixers.mamba2.verify.TUNING["tree"]`` before the launches, so the
library's own launch logic picks the tiles. One JSON line per launch: model, TP, batch, tree
size, the kernel's tile sizes and launch options, ``regs``, ``spill_stores`` and
``spill_loads`` (bytes a thread), ``stack`` (bytes) and ``shared`` (bytes a program).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # the launches run on the CPU; the compiles below do not interpret
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402

import hopper_compile  # noqa: E402
from engine_kernels import MODELS  # noqa: E402
from specla.mixers.mamba2 import verify  # noqa: E402
from specla.mixers.mamba2.serving import empty_record_buffers, mamba2_pool_verify  # noqa: E402

hopper_compile.install()  # each interpreted launch goes through compile_for_hopper, which launches() catches
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
COMPILE = r'''
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
import hopper_compile
for line in sys.stdin:
    k = hopper_compile.compile_request(json.loads(line))
    print(json.dumps({"ptx": k.asm["ptx"], "shared": k.metadata.shared}), flush=True)
'''


def launches(H: int, P: int, NG: int, NS: int, N: int, D: int) -> list[dict]:
    """The tree kernel's launch requests (:func:`hopper_compile._request`) of one verify of ``N``
    rows of ``D``-node trees (each node's parent ``(t - 1) // 2``) at this per-rank shape."""
    seen = []
    real = hopper_compile.compile_for_hopper
    hopper_compile.compile_for_hopper = lambda fn, args, kwargs: seen.append(hopper_compile._request(fn, args, kwargs))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, D, H, P, generator=g).bfloat16()
        B, C = (torch.randn(N, D, NG, NS, generator=g).bfloat16() for _ in range(2))
        parents = torch.tensor([[-1] + [(t - 1) // 2 for t in range(1, D)]] * N)
        rows = torch.arange(N, dtype=torch.int32)
        mamba2_pool_verify(torch.randn(N, H, P, NS, generator=g), x, torch.randn(N, D, H, generator=g).bfloat16(),
                           -torch.rand(H, generator=g) - 1, B, C, torch.randn(H, generator=g),
                           torch.randn(H, generator=g) * 0.1, True, rows, records=empty_record_buffers(
                               N, D, H, P, NG, NS, "cpu"), intermediate_state_indices=rows, cache_steps=D,
                           retrieve_parent_token=parents)
    finally:
        hopper_compile.compile_for_hopper = real
    return [r for r in seen if r["name"] == "_tree_verify_kernel"]


def ptxas_report(ptx: str) -> dict:
    """``ptxas -v``'s registers, spills and stack of one kernel's PTX for ``sm_90a``."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        out = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=int(re.search(r"Used (\d+) registers", out)[1]), spill_stores=int(spill[1]),
                spill_loads=int(spill[2]), stack=int(re.search(r"(\d+) bytes stack frame", out)[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="nemotron-h-8b,nemotron-h-56b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--trees", default="8,64")
    ap.add_argument("--tuning", default="{}", help='JSON merged into TUNING["tree"], e.g. \'{"BN_split": 128}\'')
    args = ap.parse_args(argv)
    if not PTXAS.exists():
        ap.error(f"no {PTXAS} (Triton's wheel ships it for CUDA targets)")
    verify.TUNING["tree"].update(json.loads(args.tuning))
    worker = subprocess.Popen([sys.executable, "-c", COMPILE, json.dumps(sys.path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    for model in args.models.split(","):
        m = MODELS[model]
        if m["op"] != "mamba2":
            ap.error(f"--models: {model} is not a Mamba2 model")
        H, NG = m["H"] // args.tp, m["NG"] // args.tp
        for N in map(int, args.batches.split(",")):
            for D in map(int, args.trees.split(",")):
                for r in launches(H, m["P"], NG, m["NS"], N, D):
                    worker.stdin.write(json.dumps(r) + "\n")
                    worker.stdin.flush()
                    got = json.loads(worker.stdout.readline())
                    tiles = {k: r["constexprs"][k] for k in ("BT", "BN", "BP")}
                    print(json.dumps(dict(model=model, tp=args.tp, batch=N, tree=D, **tiles, **r["options"],
                                          **ptxas_report(got["ptx"]), shared=got["shared"])), flush=True)
    worker.stdin.close()
    return worker.wait()


if __name__ == "__main__":
    sys.exit(main())
