"""``benchmarks/report.py``: BENCHMARKS.md's generated tables are what the script makes from the
committed raw reports, and the rows it reads from small synthetic reports, exactly."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = report  # its dataclasses look their module up
spec.loader.exec_module(report)


def test_benchmarks_md_holds_what_the_script_makes_now():
    """Fails when a raw report or the generated part of BENCHMARKS.md changed without
    ``python benchmarks/report.py --write`` (ages count to the anchor the part names)."""
    if not (ROOT / ".git").exists():
        pytest.skip("the tables read git history")
    doc = report.DOC.read_text()
    made = report.tables(report.RESULTS, report.Git(report.ROOT, report.anchor_of(doc)))
    assert report.replace_generated(doc, made) == doc


class History:
    """Stands in for :class:`report.Git`: commits oldest first; every age reads ``age of C``."""
    anchor = "fffffff"

    def __init__(self, *commits):
        self.commits = list(commits)

    def rank(self, commit):
        sha = (commit or "").split("+")[0]
        return self.commits.index(sha) if sha in self.commits else -1

    def age(self, commit):
        return f"age of {commit}"


def bench_report(**all_row):
    return {"prompts_file": "DATA/prompts/gsm8k_test.jsonl", "drafter": "/tmp/st/eagle", "batch_size": 1,
            "prompts_total": 64, "prompts_decoded": 64, "stopped_early": False,
            "config": {"num_draft_tokens": 15, "max_depth": 6, "top_k": 4, "temperature": 0.0, "dtype": "bfloat16",
                       "max_new_tokens": 128, "engine": {"budget_policy": "fixed", "prefill": "auto"}},
            "categories": {"all": {"tokens_per_s": 300.0, "ar_tokens_per_s": 200.0, "mean_accepted_tokens": 3.456,
                                   "exact_match_rate": 0.984375, **all_row}}}


@pytest.fixture
def results(tmp_path):
    """A results folder whose 2026-01-02 folder names its GPU in its README's title."""
    day = tmp_path / "benchmarks" / "results" / "2026-01-02"
    day.mkdir(parents=True)
    (day / "README.md").write_text("# Raw reports of 2026-01-02 (one NVIDIA H100, torch 2.11)\n")
    return day.parent


def write(results, name, data):
    path = results / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if not name.endswith(".jsonl") else "\n".join(json.dumps(x) for x in data))
    return path


def test_a_trained_target_row_names_its_configuration_value_and_provenance(results):
    """The speedup falls back to tokens/s over AR tokens/s; the GPU comes from the folder's
    README when the report has none; the commit from the file name; the command is the
    small_target_bench.sh row that makes the report."""
    path = write(results, "2026-01-02/small-bench-gsm8k-tree-1-aaaaaaa.json", bench_report())
    [row] = report.trained_rows(results, path, json.loads(path.read_text()))
    assert row.key == ("small", "eagle", "gsm8k_test", "tree N15 d6 k4", 1, "fixed")
    assert row.values == ["1.50x", "300", "200", "3.46", "0.984", "64 of 64"]
    assert row.source == report.Source(
        "2026-01-02", "aaaaaaa", "NVIDIA H100 (2026-01-02/README.md)",
        "bash benchmarks/scripts/small_target_bench.sh OUT DATA gsm8k:tree:1",
        "benchmarks/results/2026-01-02/small-bench-gsm8k-tree-1-aaaaaaa.json")
    r = bench_report(speedup=1.25)  # the report's own speedup first; a hybrid target's settings and MTP drafter
    r.update(drafter="mtp", batch_size=32, prompts_decoded=40, stopped_early=True, meta={"device": "NVIDIA H200"})
    r["config"].update(top_k=1, num_draft_tokens=6, temperature=0.7)
    r["config"]["engine"].update(budget_policy="adaptive", prefill="passes")
    path = write(results, "2026-01-02/small-hybrid-bench-x-bbbbbbb.json", r)
    [row] = report.trained_rows(results, path, json.loads(path.read_text()))
    assert row.key == ("small-hybrid", "mtp", "gsm8k_test", "chain N6 d6", 32, "adaptive, T 0.7, prefill passes")
    assert row.values == ["1.25x", "300", "200", "3.46", "0.984", "40 of 64 (time limit)"]
    assert (row.source.gpu, row.source.command) == (
        "NVIDIA H200 (report)", "PRESET=small-hybrid DRAFTER=mtp ENGINE='\"prefill\":\"passes\"' "
        "bash benchmarks/scripts/small_target_bench.sh OUT DATA gsm8k:chain:32:adaptive:0.7")


def test_a_report_with_flat_engine_options_reads_as_one_with_engine(results):
    """Reports written before ``EngineOptions`` hold ``budget_policy`` and ``prefill`` beside
    the other fields: the same row."""
    r = bench_report()
    r["config"].update(r["config"].pop("engine"), budget_policy="adaptive", prefill="passes")
    path = write(results, "2026-01-02/small-bench-gsm8k-tree-1-aaaaaaa.json", r)
    [row] = report.trained_rows(results, path, json.loads(path.read_text()))
    assert row.key == ("small", "eagle", "gsm8k_test", "tree N15 d6 k4", 1, "adaptive, prefill passes")
    assert row.source.command == ("ENGINE='\"prefill\":\"passes\"' bash benchmarks/scripts/small_target_bench.sh "
                                  "OUT DATA gsm8k:tree:1:adaptive")


def test_acceptance_reports_give_a_row_per_run(results):
    r = dict(bench_report(), gpu="NVIDIA H200")
    path = write(results, "2026-01-02/small-bench-b8-ccccccc.json", {"gsm8k/eagle-tree/n15/bf16": r})
    [row] = report.trained_rows(results, path, json.loads(path.read_text()))
    assert row.source == report.Source(
        "2026-01-02", "ccccccc", "NVIDIA H200 (report)",
        "python benchmarks/acceptance.py --model OUT/small --drafter OUT/eagle --prompts DATA/prompts --batch-size 1 "
        "--runs gsm8k/eagle-tree/n15/bf16",
        "benchmarks/results/2026-01-02/small-bench-b8-ccccccc.json (gsm8k/eagle-tree/n15/bf16)")


def test_the_newest_report_of_each_configuration_wins(results):
    """By date folder first, then by the commit's place in history; other configurations stay."""
    for name in ("2026-01-02/small-bench-a-bbbbbbb.json", "2026-01-02/small-bench-b-aaaaaaa.json",
                 "2026-01-01/small-bench-c-ccccccc.json"):
        write(results, name, bench_report())
    write(results, "2026-01-01/small-bench-d-ccccccc.json", dict(bench_report(), batch_size=8))
    rows = report.newest(report.all_rows(results), History("aaaaaaa", "bbbbbbb", "ccccccc"))
    assert sorted((r.key[4], r.source.commit) for r in rows) == [(1, "bbbbbbb"), (8, "ccccccc")]


def test_model_reports_split_into_cost_models_and_baselines(results):
    """specla's own rows are the cost model, the others baselines; every ratio is to specla's
    graph AR row of the same report and batch; the commit is the report's, shortened."""
    meta = {"command": "benchmarks/hybrid_study.py --out /o --models m --batches 1 --embed-scale 2000",
            "commit": "0123456789abcdef0123456789abcdef01234567+dirty", "gpu": "NVIDIA H200"}
    rows = [dict(model="m", B=1, row="transformers generate", tokens_per_s=50.0, exact=1.0),
            dict(model="m", B=1, row="specla AR (graph)", tokens_per_s=200.0, ms_per_step=5.0, accepted_per_step=0.0,
                 exact=1.0),
            dict(model="m", B=1, row="SpecLA tree", tokens_per_s=500.0, ms_per_step=9.0, accepted_per_step=4.5,
                 exact=1.0)]
    path = write(results, "2026-01-02/hybrid-m.json", {"meta": meta, "rows": rows})
    got = list(report.model_rows(results, path, json.loads(path.read_text())))
    assert [(r.question, r.key, r.values) for r in got] == [
        ("baselines", ("m", "embed x2000", 1, "transformers generate"), ["50.0", "", "", "0.25x", "1.000"]),
        ("cost", ("m", "embed x2000", 1, "specla AR (graph)"), ["200.0", "5.00", "0.00", "1.00x", "1.000"]),
        ("cost", ("m", "embed x2000", 1, "SpecLA tree"), ["500.0", "9.00", "4.50", "2.50x", "1.000"])]
    assert (got[0].source.commit, got[0].source.command) == (
        "0123456+dirty", "python benchmarks/hybrid_study.py --out /o --models m --batches 1 --embed-scale 2000")


def test_model_setup_names_the_drafter_and_profiles_that_are_not_the_defaults():
    assert report.model_setup(dict(embed_scale=2000.0)) == "embed x2000"
    assert report.model_setup(dict(embed_scale=32.0, drafter="eagle", profile=report.DEFAULT_PROFILES[0],
                                   chain_profile=report.DEFAULT_PROFILES[1])) == "embed x32"
    assert report.model_setup(dict(embed_scale=2000.0, drafter="mtp", profile="geometric:3",
                                   chain_profile="geometric:3")) == "embed x2000, mtp drafter, profile geometric:3"
    assert report.model_setup(dict(embed_scale=2000.0, profile="published:a", chain_profile="published:b")) == (
        "embed x2000, tree profile published:a, chain profile published:b")


def test_kernel_rows_put_a_case_s_batches_in_one_cell_with_the_readme_s_commit(results):
    """The folder README's file table (braces expanded) gives the commit and command of a
    report that records none."""
    (results / "2026-01-02" / "README.md").write_text(
        "# Raw reports (one NVIDIA H100)\n\n| file | command | code |\n|---|---|---|\n"
        "| `run2/{gdn,gla}.json` | `python benchmarks/kernels.py --only verify` | `ddddddd` (and more) |\n")
    verify = [dict(tree="chain T=8", batch=b, replay_ms=r, serial_ms=s, parallel_ms=p)
              for b, r, s, p in ((1, 0.0134, 0.0152, 0.0129), (64, 0.131, 0.193, 0.0973))]
    commit = [dict(batch=1, accepted=2, factor_ms=0.0054, replay_ms=0.0058)]
    path = write(results, "2026-01-02/run2/gla.json",
                 {"plugin": "gla", "gpu": "NVIDIA H200", "bandwidth_GBps": 4200.0, "verify": verify, "commit": commit})
    got = list(report.kernel_rows(results, path, json.loads(path.read_text())))
    assert [(r.key, r.values) for r in got] == [
        (("gla", "verify", "chain T=8"), ["1: 12.9 parallel / 13.4; 64: 97.3 parallel / 131.0",
                                          "FLA replay of each root-to-leaf path"]),
        (("gla", "commit", "2 accepted"), ["1: 5.4 / 5.8", "FLA token replay"])]
    assert (got[0].source.commit, got[0].source.command, got[0].source.gpu) == (
        "ddddddd", "python benchmarks/kernels.py --only verify", "NVIDIA H200 (report)")


def test_the_tables_render_each_row_with_its_provenance(results):
    write(results, "2026-01-02/small-bench-gsm8k-tree-1-aaaaaaa.json", bench_report())
    text = report.tables(results, History("aaaaaaa"))
    assert ("| small | eagle | gsm8k_test | tree N15 d6 k4 | 1 | fixed | 1.50x | 300 | 200 | 3.46 | 0.984 | 64 of 64 | "
            "NVIDIA H100 (2026-01-02/README.md) | 2026-01-02 | aaaaaaa | age of aaaaaaa | "
            "`bash benchmarks/scripts/small_target_bench.sh OUT DATA gsm8k:tree:1` | "
            "`benchmarks/results/2026-01-02/small-bench-gsm8k-tree-1-aaaaaaa.json` |") in text.splitlines()
    assert report.anchor_of(f"{report.BEGIN}\n{text}\n{report.END}") == "fffffff"


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_code_age_counts_commits_to_specla_and_plugins_up_to_the_anchor(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    shas = []
    for path in ("specla/a.py", "docs/x.md", "plugins/p.py", "BENCHMARKS.md"):
        (repo / path).parent.mkdir(exist_ok=True)
        (repo / path).write_text(path)
        _git(repo, "add", path)
        _git(repo, "commit", "-q", "-m", path)
        shas.append(_git(repo, "rev-parse", "--short=7", "HEAD"))
    git = report.Git(repo)
    assert git.anchor == shas[-1]
    assert [git.age(s) for s in shas] == [f"measured at {shas[0]}, 1 code commits ago",
                                          f"measured at {shas[1]}, 1 code commits ago", "current", "current"]
    assert git.age(shas[0] + "+dirty") == f"measured at {shas[0]}, 1 code commits ago"
    assert (git.age("0000000"), git.age(None)) == ("commit not in history", "commit not recorded")
    assert [git.rank(s) for s in shas] == [0, 1, 2, 3] and git.rank(None) == -1
    assert report.Git(repo, shas[1]).age(shas[0]) == "current"  # only docs/ changed up to that anchor


def test_the_generated_part_is_replaced_between_its_markers_only():
    doc = f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n"
    assert report.replace_generated(doc, "new") == f"intro\n{report.BEGIN}\nnew\n{report.END}\noutro\n"
    with pytest.raises(ValueError, match="needs the markers"):
        report.replace_generated("no markers", "new")
    with pytest.raises(ValueError, match="no generated part with its anchor commit"):
        report.anchor_of(doc)


def test_engine_kernels_rows_put_every_batch_in_one_cell_and_the_requests_per_model(results):
    """An engine_kernels.py report: one row per op, per-rank shape and workload (a cell naming no
    op is GDN's, as reports from before the op axis), its models, specla's time then each engine
    contender's per batch (sorted by batch), disagreement shown as NO, and per model the running
    requests a rank fits in the report's budget."""
    def cell(batch, us, agree=True, **op):
        dims = dict(H=8, P=64, NG=2, NS=128) if op else dict(H=8, HV=16, K=128, V=128)
        return {"models": "m-a (4), m-b (4)", "workload": "chain4", "batch": batch, "us": us, "agree": agree,
                **dims, **op}

    data = {"meta": {"commit": "a" * 40, "device": "GPU X", "command": "python benchmarks/engine_kernels.py"},
            "args": {"budget_gib": 10.0},
            "cells": [cell(8, {"specla": 2.25, "sglang": 3.5}), cell(1, {"specla": 1.0, "sglang": 2.0}, agree=False),
                      {**cell(1, {"specla": 4.0, "sglang": 5.0, "vllm": 6.0}, op="mamba2"), "models": "m-c (4)"}],
            "memory": [{"model": m, "tp": 4, "workload": "chain4", "contender": c, "requests_in_budget": n}
                       for m, c, n in [("m-a", "specla", 500), ("m-a", "sglang", 60), ("m-b", "specla", 600),
                                       ("m-b", "sglang", 70), ("m-c", "specla", 40), ("m-c", "sglang", 4),
                                       ("m-c", "vllm", 5)]]}
    path = results / "2026-01-02" / "engine-kernels-tp4-abcdef1.json"
    path.write_text(json.dumps(data))
    row, mamba2 = report.all_rows(results)
    assert row.question == "engines" and row.key == ("gdn", "H8 HV16 K128 V128", "chain4")
    assert row.values == ["m-a (4), m-b (4)", "1: 1.0 / 2.0; 8: 2.2 / 3.5", "sglang", "NO",
                          "10 GiB: m-a 500 / 60; m-b 600 / 70"]
    assert mamba2.key == ("mamba2", "H8 P64 NG2 NS128", "chain4")
    assert mamba2.values == ["m-c (4)", "1: 4.0 / 5.0 / 6.0", "sglang, vllm", "yes", "10 GiB: m-c 40 / 4 / 5"]
    assert (row.source.commit, row.source.gpu) == ("abcdef1", "GPU X (report)")


def test_engine_cells_out_of_memory_or_never_reached_are_named(results):
    """A cell the script listed as out of GPU memory, and in a report cut short (``complete``
    false) the batches other cases reached but this one did not, are named in the row."""
    def cell(batch, workload):
        return {"op": "mamba2", "H": 8, "P": 64, "NG": 2, "NS": 256, "models": "m (2)", "workload": workload,
                "batch": batch, "us": {"specla": 1.0, "sglang": 2.0}, "agree": True}

    write(results, "2026-01-02/engine-kernels-mamba2-tp2-abcdef1.json", {
        "meta": {"commit": "a" * 40, "device": "GPU X"}, "args": {"budget_gib": 10.0}, "memory": [], "complete": False,
        "cells": [cell(1, "tree8"), cell(8, "tree8"), cell(1, "tree64")],
        "unfit": [{"op": "mamba2", "H": 8, "P": 64, "NG": 2, "NS": 256, "models": "m (2)", "batch": 8,
                   "workload": "tree64", "error": "CUDA out of memory."}]})
    rows = {r.key[2]: r.values[1] for r in report.all_rows(results)}
    assert rows == {"tree8": "1: 1.0 / 2.0; 8: 1.0 / 2.0", "tree64": "1: 1.0 / 2.0; 8: out of GPU memory"}
    write(results, "2026-01-02/engine-kernels-mamba2-tp2-abcdef1.json", {
        "meta": {"commit": "a" * 40, "device": "GPU X"}, "args": {"budget_gib": 10.0}, "memory": [], "complete": False,
        "cells": [cell(1, "tree8"), cell(8, "tree8"), cell(1, "tree64")]})
    rows = {r.key[2]: r.values[1] for r in report.all_rows(results)}
    assert rows["tree64"] == "1: 1.0 / 2.0; 8: not run (the run stopped)"


def test_the_newest_engine_report_of_a_shape_stands_whichever_models_it_names(results):
    """Two reports of one per-rank GDN shape, the newer timing one of the models the older named:
    one row, the newer report's, with its models."""
    def data(models, us):
        return {"meta": {"commit": "a" * 40, "device": "GPU X"}, "args": {"budget_gib": 10.0}, "memory": [],
                "cells": [{"op": "gdn", "H": 8, "HV": 16, "K": 128, "V": 128, "models": models, "workload": "tree8",
                           "batch": 1, "us": {"specla": us, "sglang": 2.0}, "agree": True}]}

    write(results, "2026-01-01/engine-kernels-tp2-aaaaaaa.json", data("m-a (2), m-b (2)", 3.0))
    write(results, "2026-01-02/engine-kernels-gdn-tp2-bbbbbbb.json", data("m-a (2)", 1.0))
    [row] = report.newest(report.all_rows(results), History("aaaaaaa", "bbbbbbb"))
    assert row.values[:2] == ["m-a (2)", "1: 1.0 / 2.0"] and row.source.commit == "bbbbbbb"
