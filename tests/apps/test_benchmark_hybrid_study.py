"""``benchmarks/hybrid_study.py`` on the CPU at its tiny MoE shape (the published shapes need a GPU):
the MTP drafter's run completes with exact rows, each ratio taken against the fastest plain row,
the replayed profile recorded; the MoE shapes' experts are ones a CUDA graph records."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from specla.drafters.mtp import MTPDrafter
from specla.mixers import experts_graph_problem

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("hybrid_study", ROOT / "benchmarks" / "hybrid_study.py")
hs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hs)

PLAIN = ("specla AR (graph)", "transformers generate")


def test_moe_shape_with_the_mtp_drafter_runs_exact_against_the_fastest_plain_row(tmp_path, monkeypatch):
    heads, real = [], hs.draft_head
    monkeypatch.setattr(hs, "draft_head", lambda kind, model: heads.append(real(kind, model)) or heads[-1])
    plots = importlib.util.find_spec("matplotlib") is not None
    monkeypatch.setattr(sys, "argv", [
        "hybrid_study.py", "--out", str(tmp_path), "--models", "qwen3_5-moe-tiny", "--drafter", "mtp",
        "--batches", "1,3", "--tokens", "12", "--repeats", "1", "--device", "cpu", "--profile", "geometric:3",
        "--chain-profile", "geometric:3", "--allow-dirty", *([] if plots else ["--no-plot"])])
    hs.main()
    data = json.loads((tmp_path / "hybrid.json").read_text())
    rows, meta = data["rows"], data["meta"]
    assert [cls for cls, _ in heads] == [MTPDrafter]
    assert meta["args"]["drafter"] == "mtp"
    for kind in ("chain", "tree"):  # the replayed profile is in the report: 3 accepted drafts a step
        p = meta["profiles"][kind]
        assert len(p) == 7 and sum(a * q for a, q in enumerate(p)) == pytest.approx(3.0, abs=1e-9)
    assert sorted((r["B"], r["row"]) for r in rows) == sorted(
        (B, row) for B in (1, 3) for row in ("specla AR (graph)", "SpecLA chain", "SpecLA tree"))
    for B in (1, 3):
        mine = [r for r in rows if r["B"] == B]
        best = max(r["tokens_per_s"] for r in mine if r["row"] in PLAIN)
        for r in mine:
            assert r["exact"] == 1.0, r
            assert r["vs_best_ar"] == pytest.approx(r["tokens_per_s"] / best, rel=1e-12), r
            # plain rows accept nothing; the replayed profile (3 a step) accepts some, at most its depth
            assert (r["accepted_per_step"] == 0) if r["row"] in PLAIN else (0 < r["accepted_per_step"] <= 6), r
        assert all((r["record_mib"] or 0) > 0 for r in mine if r["row"].startswith("SpecLA")) == (B == 1)
    if plots:  # the run's plot, and again from its JSON
        assert (tmp_path / "hybrid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        monkeypatch.setattr(sys, "argv", ["hybrid_study.py", "--out", str(tmp_path / "again"), "--replot",
                                          str(tmp_path / "hybrid.json")])
        hs.main()
        assert (tmp_path / "again" / "hybrid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moe_shapes_run_experts_a_cuda_graph_records():
    plugin, model = hs.build("qwen3_5-moe-tiny", 32.0, "cpu", torch.bfloat16)
    assert plugin == "qwen" and experts_graph_problem(model, torch.bfloat16) is None
    cls, head = hs.draft_head("mtp", model)
    experts = head.layers[0].mlp.experts
    assert cls is MTPDrafter and experts.config._experts_implementation == "grouped_mm"
    assert all(torch.isfinite(p).all() and p.abs().max() < 1 for p in head.parameters())  # initialised, not unset
    # the GPU shape, built without memory: 20 of Qwen3.5-35B-A3B's 40 layers, 5 of them attention
    _, big = hs.build("qwen3_5-35b-a3b-20l", 2000.0, "meta", torch.bfloat16)
    assert list(big.config.layer_types).count("full_attention") == 5 and len(big.config.layer_types) == 20
    assert sum(p.numel() for p in big.parameters()) == 17_838_865_728
    assert experts_graph_problem(big, torch.bfloat16) is None


def test_the_mtp_drafter_refuses_models_of_other_plugins(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hybrid_study.py", "--out", str(tmp_path), "--models", "bamba-tiny",
                                      "--drafter", "mtp", "--device", "cpu", "--no-plot", "--allow-dirty"])
    with pytest.raises(SystemExit):
        hs.main()
    assert "not qwen models" in capsys.readouterr().err
