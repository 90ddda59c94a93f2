"""The CPU-checkable parts of ``benchmarks/e2e.py`` (the GDN-1.3B study itself needs a GPU): the
oracle drafter's acceptance follows its profile, greedy output stays exact with and without the
fixed-shape (graph) step, measured profiles are read as they were recorded, the tables say
"not run" for missing cells instead of failing, and the transformers ``generate`` row is checked
against the AR row with the installed library versions recorded."""

import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specla import SpecConfig
from specla.api import SpecDecoder
from specla.registry import get_plugin

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("e2e_bench", ROOT / "benchmarks" / "e2e.py")
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)


@pytest.fixture(scope="module")
def margin_model():
    """The tiny GDN test model with the study's embedding trick: the greedy token is the input."""
    model = get_plugin("gdn").tiny_model("base", seed=0, dtype=torch.float32)
    with torch.no_grad():
        model.model.embeddings.weight.mul_(32)
        model.lm_head.weight.copy_(model.model.embeddings.weight)
    return model


@pytest.mark.parametrize("graphs", ["off", "unrecorded"])
def test_oracle_drafter_follows_its_profile_and_output_is_exact(margin_model, graphs):
    alpha, D = 0.8, 6
    torch.manual_seed(0)
    cfg = SpecConfig(num_draft_tokens=16, max_depth=D, top_k=4, max_new_tokens=300, stop_at_eos=False,
                     engine=dict(cuda_graphs=graphs))
    prompts = [[5, 6, 7], [9], [11, 12]]
    spec = SpecDecoder(margin_model, "gdn", drafter=e2e.ProfileDrafter(e2e.geometric(alpha, D)), config=cfg)
    r = spec.generate(prompts)
    ar = SpecDecoder(margin_model, "gdn", config=cfg.model_copy(update=dict(num_draft_tokens=0))).generate(prompts)
    assert r.outputs == ar.outputs and all(o == [p[-1]] * 300 for o, p in zip(r.outputs, prompts))
    expected = sum(alpha**k for k in range(1, D + 1))  # E[a] with P(a >= k) = alpha^k
    hist = r.stats.accepted_histogram
    n = sum(hist)
    assert abs(r.stats.mean_accepted_tokens - expected) < 4 * 2.0 / n**0.5  # a stays within 0..6
    assert hist[D] > 0 and hist[0] > 0


def test_measured_profile_is_read_as_recorded(tmp_path):
    report = {"gsm8k/eagle-tree": {"categories": {"all": {"accepted_histogram": [1, 1, 2, 0, 0, 0, 4]}}}}
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(report))
    assert e2e.measured_profile(f"{path}:gsm8k/eagle-tree") == [0.125, 0.125, 0.25, 0, 0, 0, 0.5]
    with pytest.raises(ValueError, match="max_depth 5"):
        e2e.measured_profile(f"{path}:gsm8k/eagle-tree", D=5)


def test_published_profiles_load_at_their_depth_and_at_the_study_depth():
    profiles = json.loads(e2e.PUBLISHED.read_text())["profiles"]
    assert profiles
    for name, entry in profiles.items():
        d = entry["settings"]["max_depth"]
        assert entry["shape"] in ("chain", "tree"), name
        assert len(entry["histogram"]) == d + 1, name
        assert abs(sum(entry["histogram"]) - 1) < 1e-3, name
        if "accepted_length" in entry:  # counts the bonus token; published to two decimals
            mean = sum(a * p for a, p in enumerate(entry["histogram"]))
            assert abs(1 + mean - entry["accepted_length"]) <= 5e-3, name
        own = e2e.measured_profile(f"published:{name}", D=d)
        assert own == pytest.approx([h / sum(entry["histogram"]) for h in entry["histogram"]], abs=1e-12)
        study = e2e.measured_profile(f"published:{name}")
        assert len(study) == 7 and abs(sum(study) - 1) < 1e-12, name
        # cut deeper: min(a, 6) keeps the mass of a >= 6 in the last bin; padded shallower: zeros
        assert study[:min(d, 6)] == pytest.approx(own[:min(d, 6)], abs=1e-12)
        assert study[6] == pytest.approx(sum(own[6:]), abs=1e-12) if d >= 6 else study[d + 1:] == [0.0] * (6 - d)


def test_published_profile_values_and_unknown_name():
    assert e2e.measured_profile("published:qwen3.6-27b-mtp-d6") == pytest.approx(
        [0.083, 0.08, 0.189, 0.11, 0.087, 0.103, 0.348], abs=1e-12)
    assert e2e.measured_profile("published:deepseek-v3-mtp-sglang-chain") == pytest.approx(
        [0.1, 0.9, 0, 0, 0, 0, 0], abs=1e-12)
    known = ", ".join(sorted(json.loads(e2e.PUBLISHED.read_text())["profiles"]))
    with pytest.raises(ValueError) as err:
        e2e.measured_profile("published:no-such-drafter")
    assert str(err.value) == f"published:no-such-drafter: no such published profile; known: {known}"
    assert "eagle3-llama3.1-8b-steps8" in known and "deepseek-v3-mtp-sglang-tree" in known


def test_geometric_profile_has_the_asked_mean_of_accepted_drafts():
    for mean, D in ((3.0, 6), (0.0, 6), (6.0, 6), (1.5, 2)):
        p = e2e.measured_profile(f"geometric:{mean}", D=D)
        alpha = e2e.alpha_for_mean(mean, D)
        assert p == pytest.approx(e2e.geometric(alpha, D), abs=1e-15)
        assert len(p) == D + 1 and sum(p) == pytest.approx(1.0, abs=1e-12)
        assert sum(a * q for a, q in enumerate(p)) == pytest.approx(mean, abs=1e-9)
    assert e2e.alpha_for_mean(3.0, 6) == pytest.approx(0.80455, abs=1e-5)
    with pytest.raises(ValueError, match="outside 0..6"):
        e2e.measured_profile("geometric:6.5")

def test_tables_mark_cells_that_were_not_run():
    rows = [dict(study="step", N=0, B=1, ms_per_step=3.0, vs_ar_step=1.0),
            dict(study="step", N=16, B=1, ms_per_step=4.9, vs_ar_step=1.63),
            dict(study="step", N=0, B=8, ms_per_step=4.4, vs_ar_step=1.0)]
    text = e2e.tables(rows)
    assert "| 1 | 3.000 (1.00x) | 4.900 (1.63x) |" in text and "| 8 | 4.400 (1.00x) | not run |" in text


@pytest.mark.parametrize("variant", ["base", "gva"])
def test_fla_sd_baseline_decodes_like_the_reference_replay(variant, monkeypatch):
    """The FLA-SD row (FLA's stock kernel for verify's recurrence and the replay commit, run by
    the Triton interpreter here): same tokens as autoregressive decoding and as specla's own
    replay commit, and the same recurrent states after decoding (float32), with drafts accepted
    (so replays of several tokens happened); trees are refused."""
    from fla_oracle import enable_fla_interpreter

    enable_fla_interpreter()
    import fla.ops.gated_delta_rule as fla_gdr

    calls, kernel = [], fla_gdr.fused_recurrent_gated_delta_rule
    monkeypatch.setattr(fla_gdr, "fused_recurrent_gated_delta_rule",
                        lambda *a, **kw: calls.append(kw["output_final_state"]) or kernel(*a, **kw))
    model = get_plugin("gdn").tiny_model(variant, seed=0, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    V = model.get_input_embeddings().weight.shape[0]
    motif = torch.randint(0, V, (4,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(0, V, (7,), generator=g).tolist() + motif * 2]
    cfg = dict(num_draft_tokens=4, max_depth=4, top_k=1, max_new_tokens=20, stop_at_eos=False, dtype="float32",
               engine=dict(commit="replay", cuda_graphs="off", kernels="reference"))
    ref = SpecDecoder(model, "gdn", drafter="ngram", config=cfg)
    fla = e2e.use_fla_sd(SpecDecoder(model, "gdn", drafter="ngram", config=cfg))
    assert fla.adapter._verify.__func__ is e2e.fla_sd_verify
    r_ref, r_fla = ref.generate(prompts), fla.generate(prompts)
    ar = SpecDecoder(model, "gdn", config=dict(cfg, num_draft_tokens=0)).generate(prompts)
    assert r_fla.outputs == r_ref.outputs == ar.outputs
    assert r_fla.stats.mean_accepted_tokens > 0
    assert True in calls and False in calls  # FLA's kernel ran for verify and for commit
    for s_ref, s_fla in zip(ref.adapter.recurrent_states(), fla.adapter.recurrent_states()):
        torch.testing.assert_close(s_fla, s_ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="chain drafts"):
        e2e.use_fla_sd(SpecDecoder(model, "gdn", config=dict(cfg, top_k=2)))
    from specla.tree import DraftTree

    fla.adapter.prefill([prompts[0]])
    with pytest.raises(ValueError, match="chains only"):  # a drafter that branches anyway
        fla.adapter.verify(DraftTree.from_lists([([1, 2, 3], [-1, 0, 0])]))


def test_the_plots_name_the_bench_extra_when_matplotlib_is_missing(monkeypatch, capsys, tmp_path):
    """Without matplotlib, ``--replot`` (and a run, before it measures) stops with one line naming
    the extra to install, and writes nothing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` raises ImportError
    run = ROOT / "benchmarks/results/2026-12-04/gdn13b-e2e-core-b2b1fbd.json"
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--out", str(tmp_path), "--replot", str(run)])
    with pytest.raises(SystemExit) as stop:
        e2e.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("e2e.py: error: the plots need matplotlib, which is not "
                                                         "installed: pip install 'specla[bench]'")
    assert list(tmp_path.iterdir()) == []


def test_baseline_tables_show_the_ratio_to_the_best_ar_row():
    """The baselines table has a ``vs best AR`` column (the faster of specla's graph AR and FLA's
    graph-captured model); rows measured before it existed read ``nan``."""
    rows = [dict(study="baselines", B=1, row="AR, specla graph", tokens_per_s=500.0, vs_ar_graph=1.0,
                 vs_best_ar=0.8, ms_per_step=2.0),
            dict(study="baselines", B=1, row=e2e.FLA_GRAPH, tokens_per_s=625.0, vs_ar_graph=1.25, vs_best_ar=1.0,
                 ms_per_step=1.6),
            dict(study="baselines", B=1, row="SpecLA tree", tokens_per_s=900.0, vs_ar_graph=1.8, ms_per_step=5.0)]
    text = e2e.tables(rows)
    assert "| vs best AR | vs AR graph |" in text
    assert "| 1 | AR, specla graph | 500 | 0.80x | 1.00x |" in text
    assert f"| 1 | {e2e.FLA_GRAPH} | 625 | 1.00x | 1.25x |" in text
    assert "| 1 | SpecLA tree | 900 | nanx | 1.80x |" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_graph_step_times_the_models_cached_one_token_forward():
    """The FLA baseline runs on a tiny FLA GDN model: a positive step time and kernels launched."""
    model = get_plugin("gdn").tiny_model("base", seed=0, dtype=torch.float32).cuda()
    ms, kernels = e2e.fla_graph_step(model, [[3, 4, 5, 6]] * 2, replays=5)
    assert ms > 0 and kernels > 0


# ------------------------------------------------------------------ the transformers generate row


def test_exact_rate_compares_each_output_with_its_reference_prefix():
    assert e2e.exact_rate([[1, 2], [3, 4]], [[1, 2, 9], [3, 5, 9]]) == 0.5
    assert e2e.exact_rate([[1, 2, 9]], [[1, 2, 9]]) == 1.0
    with pytest.raises(ValueError, match="longer than its reference"):
        e2e.exact_rate([[1, 2, 3]], [[1, 2]])
    with pytest.raises(ValueError, match="2 outputs against 1 references"):
        e2e.exact_rate([[1], [2]], [[1]])


def test_library_versions_are_the_installed_ones():
    from specla.apps.bench import library_versions

    v = library_versions()
    assert list(v) == ["torch", "triton", "transformers", "flash-linear-attention", "fla-core", "specla"]
    assert v["specla"] == importlib.metadata.version("specla")
    assert v["transformers"] == importlib.metadata.version("transformers")
    assert v["flash-linear-attention"] == importlib.metadata.version("flash-linear-attention")
    assert v["torch"] == importlib.metadata.version("torch") and v["triton"] == importlib.metadata.version("triton")


def test_the_transformers_generate_row_is_checked_against_ar():
    """The row's ``exact`` is the share of its tokens equal to specla's AR tokens: 1.0 with
    FLA's uncached ``generate``; its cached ``generate`` (what the row times) matches AR only
    with transformers < 5.24, where the cache still reaches FLA's model (docs/usage.md,
    "Precision and exactness")."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # FLA's kernels on the CPU
        from fla_oracle import enable_fla_interpreter

        enable_fla_interpreter()
        dev = "cpu"
    elif torch.cuda.is_available():  # FLA's kernels compiled
        dev = "cuda"
    else:
        pytest.skip("FLA's kernels need CUDA or TRITON_INTERPRET=1")
    model = get_plugin("gdn").tiny_model("base", seed=0, dtype=torch.float32).to(dev)
    prompts = [[3, 17, 5, 9], [40, 2, 33, 8]]
    n = 6
    ar = SpecDecoder(model, "gdn", config=dict(num_draft_tokens=0, max_new_tokens=8, stop_at_eos=False,
                                               dtype="float32", device=dev)).generate(prompts).outputs
    assert e2e.exact_rate(e2e.hf_generate_outputs(model, prompts, n, use_cache=False), ar) == 1.0
    h = e2e.Harness.__new__(e2e.Harness)  # the row's own code, on the tiny model (no GPU)
    h.model, h.prompts, h.args = model, prompts, SimpleNamespace(hf_tokens=n, repeats=1)
    row = h.hf_generate(2, 100.0, ar)
    assert set(row) == {"tokens_per_s", "vs_ar_graph", "ms_per_step", "exact"}
    tf = tuple(int(x) for x in importlib.metadata.version("transformers").split(".")[:2])
    assert row["exact"] == (1.0 if tf < (5, 24) else 0.0)
    with pytest.raises(ValueError, match="prompts of one length"):
        e2e.hf_generate_outputs(model, [[1, 2], [3]], n)
