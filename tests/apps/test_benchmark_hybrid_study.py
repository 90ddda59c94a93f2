"""``benchmarks/hybrid_study.py`` on the CPU at its tiny MoE and GLA shapes (the published shapes need a
GPU): the MTP drafter's run and FLA's GLA run complete with exact rows, each ratio taken against the
fastest plain row, the replayed profile recorded; the MoE shapes' experts are ones a CUDA graph
records; the GLA-1.3B shape is FLA's own GLAForCausalLM at that checkpoint's config."""

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


def test_fla_gla_shape_runs_exact_against_the_fastest_plain_row(tmp_path, monkeypatch):
    """A SHAPES entry naming its classes as ``module:attr`` builds FLA's GLA, which the gla plugin runs."""
    from fla.models import GLAForCausalLM

    built, real = [], hs.build
    monkeypatch.setattr(hs, "build", lambda *a: built.append(real(*a)) or built[-1])
    monkeypatch.setattr(sys, "argv", [
        "hybrid_study.py", "--out", str(tmp_path), "--models", "gla-tiny", "--batches", "1,2", "--tokens", "12",
        "--repeats", "1", "--device", "cpu", "--profile", "geometric:3", "--chain-profile", "geometric:3",
        "--allow-dirty", "--no-plot"])
    hs.main()
    [(plugin, model)] = built
    assert plugin == "gla" and type(model) is GLAForCausalLM
    rows = json.loads((tmp_path / "hybrid.json").read_text())["rows"]
    assert sorted((r["B"], r["row"]) for r in rows) == sorted(
        (B, row) for B in (1, 2) for row in ("specla AR (graph)", "SpecLA chain", "SpecLA tree"))
    assert {r["params"] for r in rows} == {sum(p.numel() for p in model.parameters())}
    for B in (1, 2):
        mine = [r for r in rows if r["B"] == B]
        best = max(r["tokens_per_s"] for r in mine if r["row"] in PLAIN)
        for r in mine:
            assert r["model"] == "gla-tiny" and r["exact"] == 1.0, r
            assert r["vs_best_ar"] == pytest.approx(r["tokens_per_s"] / best, rel=1e-12), r
            assert (r["accepted_per_step"] == 0) if r["row"] in PLAIN else (0 < r["accepted_per_step"] <= 6), r


def test_the_gla_1_3b_shape_is_flas_model_at_the_published_config():
    """fla-hub/gla-1.3B-100B's config (FLA's GLAConfig defaults): the parameter count is FLA's own
    model's at those values, written out here rather than read from SHAPES."""
    from fla.models import GLAConfig, GLAForCausalLM

    published = dict(hidden_size=2048, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1, vocab_size=32000,
                     hidden_ratio=4, use_short_conv=False, use_output_gate=True, tie_word_embeddings=False)
    plugin, model = hs.build("gla-1.3b", 2000.0, "meta", torch.bfloat16)
    with torch.device("meta"):
        ref = GLAForCausalLM(GLAConfig(**published))
    assert plugin == "gla" and type(model) is GLAForCausalLM and model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert [p.shape for p in model.parameters()] == [p.shape for p in ref.parameters()]
    layers = model.model.layers
    assert len(layers) == 24 and all(b.attn.num_heads == 4 for b in layers)
    assert all((b.attn.head_k_dim, b.attn.head_v_dim) == (256, 512) for b in layers)  # benchmarks/kernels.py's gla
    assert not any(b.attn.use_short_conv for b in layers) and all(b.attn.use_output_gate for b in layers)
    assert model.lm_head.weight is not model.get_input_embeddings().weight  # untied
