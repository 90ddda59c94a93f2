"""``benchmarks/engine_kernels.py`` on the CPU under Triton's interpreter (on a CUDA machine, compiled
on the GPU), its ``tiny`` preset (float32, two layers of each op: GDN H = 2, HV = 4, K = 16, V = 64;
Mamba2 H = 4, P = 16, NG = 2, NS = 16; KDA H = 2, K = V = 16): every cell's contenders agree, the report has every cell, and its memory
figures are the bytes of the buffers each engine allocates. The engines' kernel files are
extracted into a folder the script reads (``--extract``'s layout); without network the test
skips, like the oracle tests."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specla.testing import engine_kernels

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine_kernels.py"


def test_tiny_preset_agrees_and_reports_every_cell(tmp_path):
    try:
        engine_kernels.extract(tmp_path / "engines")
    except engine_kernels.RegistryUnreachable as err:
        pytest.skip(str(err))
    out = tmp_path / "report.json"
    # where the test run compiles Triton's kernels (a CUDA machine), the script runs them compiled on
    # the GPU; elsewhere on the CPU under the interpreter
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernels", str(tmp_path / "engines"), "--device", device,
                           "--preset", "tiny", "--reps", "1", "--out", str(out), "--allow-dirty",
                           "--mamba2-serial", "8,1", "--mamba2-stages", "1",  # Mamba2's chains split P = 16 in two
                           "--kda-tree-prepare", "separate"],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRITON_INTERPRET="1" if device == "cpu" else "0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] is True  # rewritten after each cell, complete after the last
    cells = report["cells"]
    assert [(c["op"], c["batch"], c["workload"]) for c in cells] == [
        (op, N, w) for op in ("gdn", "mamba2", "kda") for N in (1, 3) for w in ("tree6", "chain3")]
    chain = {"gdn": {"specla", "sglang_replayssm", "vllm", "vllm_fused_mtp"}, "mamba2": {"specla", "vllm"},
             "kda": {"specla", "sglang_replayssm", "vllm"}}
    # float32, observed at most: GDN 8.9e-8 / 2.4e-7 (outputs up to 0.35, states up to 1.4); KDA 4.5e-8 /
    # 2.4e-7 (0.23, 1.1); Mamba2 2.9e-6 / 8.3e-7 (outputs up to 10.5, states up to 1.3)
    tol = {"gdn": 2e-6, "kda": 2e-6, "mamba2": 3e-5}
    for c in cells:
        assert c["agree"], c["errors"]
        others = {"specla"} if c["workload"] == "tree6" else chain[c["op"]]
        assert set(c["us"]) == others | {"sglang"}
        for name in others:
            assert c["errors"][name]["out"] < tol[c["op"]] and c["errors"][name]["state"] < tol[c["op"]]
    # one layer's bytes a running request holds beyond its float32 state slot: GDN 4 x 64 x 16,
    # Mamba2 4 x 16 x 16, KDA 2 x 16 x 16; specla's records a node: GDN k, v, gate; Mamba2 B, u =
    # dt x, gate; KDA k, delta, per-channel gate; ReplaySSM's rings a token: raw k, v, gate, beta
    gdn = dict(state=16384, node=(2 * 16 + 4 * 64 + 4) * 4, ring=(2 * 16 + 4 * 64) * 4 + 2 * 4 * 4)
    kda = dict(state=2048, node=(2 * 16 + 2 * 16 + 2 * 16) * 4, ring=(2 * 16 + 2 * 16) * 4 + (2 * 16 + 2) * 4)
    mamba2 = dict(state=4096, node=(2 * 16 + 4 * 16 + 4) * 4)
    spec = {}
    for op, m in (("gdn", gdn), ("mamba2", mamba2), ("kda", kda)):
        for D, w in ((6, "tree6"), (3, "chain3")):
            spec[op, w, "sglang"], spec[op, w, "specla"] = D * m["state"], D * m["node"]
        spec[op, "chain3", "vllm"] = 2 * m["state"]  # vLLM's slots of the chain's 2 other positions
        if "ring" in m:
            spec[op, "chain3", "sglang_replayssm"] = 3 * m["ring"]
    spec["gdn", "chain3", "vllm_fused_mtp"] = spec["gdn", "chain3", "vllm"]
    rows = {(m["op"], m["workload"], m["contender"]): m for m in report["memory"]}
    assert set(rows) == set(spec)
    state = {"gdn": gdn["state"], "mamba2": mamba2["state"], "kda": kda["state"]}
    model = {"gdn": "tiny", "mamba2": "tiny-mamba2", "kda": "tiny-kda"}
    for key, m in rows.items():
        op = key[0]
        assert (m["model"], m["tp"], m["spec_layer_bytes"], m["layer_bytes"]) == (
            model[op], 1, spec[key], state[op] + spec[key])
        per_request = 2 * m["layer_bytes"]  # the tiny models' two layers
        assert (m["model_bytes"], m["requests_in_budget"]) == (per_request, 10 * 2**30 // per_request)
    assert report["meta"]["engines"] == {"sglang": "0.5.23", "vllm": "0.34.0"}
    assert report["meta"]["mamba2_serial_tuning"] == {"BP": 8, "num_warps": 1}
    assert report["meta"]["mamba2_tree_tuning"]["num_stages"] == 1
    assert report["meta"]["kda_tree_tuning"]["prepare"] == "separate"
    assert {"commit", "device", "versions", "date", "command"} <= set(report["meta"])
    table = out.with_suffix(".md").read_text()
    assert table.count("| yes |") == 12 and "**NO**" not in table
    assert "vllm_fused_mtp: vLLM's ROCm Triton port of the compiled CUDA op" in table


def _script():
    """The script as a module (its imports of ``kernels`` and ``provenance`` need its folder on
    the path while it loads)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("engine_kernels_bench", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_the_check_marks_a_contender_that_disagrees():
    bench = _script()
    gen = torch.Generator().manual_seed(0)
    o, s = torch.randn(1, 6, 4, 16, generator=gen).bfloat16(), torch.randn(3, 4, 16, 16, generator=gen)
    ulp = o.float() * 2**-8  # one bf16 rounding of an output: within tolerance
    errors, ok = bench.check({"sglang": (o, s), "near": ((o.float() + ulp).bfloat16(), s + 1e-5 * s.abs().max()),
                              "far": (o, s + 1e-3 * s.abs().max()), "nan": (o * float("nan"), s)})
    assert not ok
    assert (errors["near"]["agree"], errors["far"]["agree"], errors["nan"]["agree"]) == (True, False, False)
    assert errors["far"]["state"] == pytest.approx(1e-3 * s.abs().max().item(), rel=1e-3)


def test_a_kernel_folder_without_the_files_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernels", str(tmp_path), "--out", str(tmp_path / "r.json"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"engine_kernels.py: error: sglang 0.5.23's kernel files are not under {tmp_path}: ")
    assert proc.stderr.count("\n") == 1


def test_arguments_are_checked_before_the_engines_load(tmp_path):
    """A wrong ``--models`` is refused by name even where the engines' kernel files are missing."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernels", str(tmp_path), "--out", str(tmp_path / "r.json"),
                           "--device", "cpu", "--models", "no-such-model"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith("engine_kernels.py: error: --models: unknown no-such-model (of ")


@pytest.mark.parametrize("args, want", [(["--trees=", "--chains="], "--trees and --chains are both empty: nothing to time"),
                                        (["--batches="], "--batches is empty")])
def test_empty_lists_are_refused(tmp_path, args, want):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernels", str(tmp_path), "--out", str(tmp_path / "r.json"),
                           "--device", "cpu", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == f"engine_kernels.py: error: {want}"


TILES = "two powers of two >= 16 as BV,BKC"
MAMBA2 = "BP,WARPS with BP a power of two >= 16 and WARPS one of 1, 2, 4, 8, 16"
SERIAL = "BP,WARPS with BP a power of two and WARPS one of 1, 2, 4, 8, 16"


@pytest.mark.parametrize("flag, value, want", [
    *[("--tree-tiles", v, TILES) for v in ("12,32", "64", "64,32,16", "a,b")],
    *[("--mamba2-tree", v, MAMBA2) for v in ("12,4", "8,4", "32,3", "32", "a,b")],
    *[("--mamba2-serial", v, SERIAL) for v in ("12,4", "0,4", "8,3", "8", "a,b")],
    *[("--kda-serial", v, SERIAL.replace("BP", "BV")) for v in ("12,4", "8,3")]])
def test_kernel_settings_out_of_their_forms_are_refused(tmp_path, flag, value, want):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.json"), "--device", "cpu",
                           flag, value], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == f"engine_kernels.py: error: {flag}: {want}, got {value!r}"


def test_a_cell_out_of_gpu_memory_is_named_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """A cell whose buffers outgrow the card (SGLang's per-node states at large batches and trees)
    is listed under ``unfit`` with the allocator's first line; every other cell still runs."""
    bench = _script()
    probe = SimpleNamespace(recurrent=SimpleNamespace(_is_sm90=False, is_arch_support_pdl=lambda: False))
    for loader in ("load_sglang", "load_vllm", "load_vllm_mtp", "load_vllm_kda", "load_vllm_mamba2"):
        monkeypatch.setattr(bench.engine_kernels, loader, lambda *a, **k: probe)

    def run_cell(eng, op, shape, N, kind, D, args, seed):
        if (N, kind) == (3, "tree"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore advice")
        mem = {"specla": dict(slot_bytes=64, spec_bytes=8)}
        return dict(op=op, **shape, batch=N, workload=f"{kind}{D}", input_sets=1, us={"specla": 1.0}, memory=mem,
                    errors={}, agree=True)

    monkeypatch.setattr(bench, "run_cell", run_cell)
    out = tmp_path / "r.json"
    assert bench.main(["--kernels", str(tmp_path), "--device", "cpu", "--preset", "tiny", "--ops", "gdn",
                       "--out", str(out), "--allow-dirty"]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True
    assert [(c["batch"], c["workload"]) for c in report["cells"]] == [(1, "tree6"), (1, "chain3"), (3, "chain3")]
    assert report["unfit"] == [dict(op="gdn", H=2, HV=4, K=16, V=64, models="tiny (1)", batch=3, workload="tree6",
                                    error="CUDA out of memory. Tried to allocate 2.00 GiB.")]
    assert "| gdn | tiny (1) | | 3 | tree6 | out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB. |" \
        in out.with_suffix(".md").read_text()
