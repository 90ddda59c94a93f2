"""``benchmarks/cost_model.py``: speedups from the formula on synthetic raw reports, the depth
cap, "not measured" cells, which report a cell comes from, and that ``docs/cost-model.md`` and
the committed JSON hold what the script makes of the committed reports."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cost_model", ROOT / "benchmarks" / "cost_model.py")
cm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cm)


def hybrid(results: Path, name: str, date: str, commit: str, rows: list[dict]) -> Path:
    """A ``hybrid_study.py`` report of shape ``m`` in ``results/date/``."""
    path = results / date / name
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"model": "m", "params": 1, "accepted_per_step": 4.0, "exact": 1.0, **r} for r in rows]
    path.write_text(json.dumps(dict(meta=dict(commit=commit, date=date, gpu="GPU X"), rows=rows)))
    return path


def run(results: Path) -> list[dict]:
    return cm.cells(cm.select(cm.reports(results)))


def pick(cs, **kw) -> list[dict]:
    return [c for c in cs if all(c[k] == v for k, v in kw.items())]


AR = dict(row="specla AR (graph)", ms_per_step=2.0)


def test_speedups_follow_the_formula_against_the_fastest_plain_decoding(tmp_path):
    hybrid(tmp_path, "hybrid-m.json", "2026-12-01", "abc1234", [
        dict(B=1, row="transformers generate", tokens_per_s=100.0),  # 10 ms per step: slower
        dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=5.0, vs_best_ar=1.9),
        dict(B=1, row="SpecLA tree", ms_per_step=8.0)])
    cs = run(tmp_path)
    assert [c["speedup"] for c in pick(cs, batch=1, kind="chain")] == [0.8, 1.2, 1.6, 2.0, 2.4, 2.8]
    assert [c["speedup"] for c in pick(cs, batch=1, kind="tree")] == [0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    c = pick(cs, batch=1, kind="chain", L=3)[0]
    assert c == dict(shape="m", batch=1, kind="chain", num_draft_tokens=6, max_depth=6, L=3, status="measured",
                     speedup=1.6, t_ar_ms=2.0, t_spec_ms=5.0, ar_row="specla AR (graph)", measured_at_L=4.0,
                     measured_speedup=1.9, slower_plain_ms={"transformers generate": 10.0},
                     source=str(tmp_path / "2026-12-01" / "hybrid-m.json"), commit="abc1234", date="2026-12-01",
                     device="GPU X")
    table = cm.table(cs)
    assert "| 1 | chain | 2.000 | 5.000 | 4.00: 1.90x | **0.80x** | 1.20x | 1.60x | 2.00x | 2.40x | 2.80x |" in table
    assert "| 1 | tree | 2.000 | 8.000 | 4.00: not recorded | **0.50x** | **0.75x** | 1.00x | 1.25x | 1.50x | 1.75x |" \
        in table
    assert "- plain decoding, ms per step, fastest (t_ar) first: batch 1: specla AR (graph) 2.000, " \
           "transformers generate 10.000" in table


def test_t_ar_is_the_fastest_plain_row_of_an_e2e_report(tmp_path):
    """FLA's model in a CUDA graph was faster than specla's AR step at batch 64 in some runs."""
    path = tmp_path / "2026-12-04" / "gdn13b-e2e-core-abc1234.json"
    path.parent.mkdir()
    rows = [dict(study="baselines", B=64, row="AR, specla graph", ms_per_step=5.0),
            dict(study="baselines", B=64, row="AR, FLA model in a CUDA graph", ms_per_step=4.0),
            dict(study="baselines", B=64, row="SpecLA chain", ms_per_step=10.0, accepted_per_step=4.25, exact=1.0),
            dict(study="baselines", B=64, row="spec tree, snapshot commit", ms_per_step=1.0, accepted_per_step=4.0),
            dict(study="step", B=64, N=16, ms_per_step=1.0)]
    path.write_text(json.dumps(dict(meta=dict(commit="abc1234", date="2026-12-04", gpu="GPU X", args=dict(layers=24)),
                                    rows=rows)))
    cs = run(tmp_path)
    c = pick(cs, shape="gdn-1.3b", batch=64, kind="chain", L=1)[0]
    assert (c["t_ar_ms"], c["ar_row"], c["speedup"], c["slower_plain_ms"]) == \
        (4.0, "AR, FLA model in a CUDA graph", 0.8, {"AR, specla graph": 5.0})
    assert {c["status"] for c in pick(cs, batch=64, kind="tree")} == {"not measured"}  # snapshot is no SpecLA tree


def test_policy_probe_step_time_is_the_last_calls_decode_time_per_step(tmp_path):
    path = tmp_path / "2026-12-02" / "policy-probe-steady-b1-8-abc1234.jsonl"
    path.parent.mkdir()
    lines = [dict(batch=1, row=row, last_call=dict(steps=steps, wall_s=wall, prefill_s=0.01, mean_accepted_tokens=acc))
             for row, steps, wall, acc in (("ar", 100, 0.11, 0.0), ("tree", 20, 0.05, 4.0),
                                           ("tree-adaptive", 10, 0.02, 5.0))]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cs = run(tmp_path)
    c = pick(cs, shape="small", batch=1, kind="tree", L=4)[0]
    assert (c["t_ar_ms"], c["t_spec_ms"], c["speedup"], c["measured_speedup"], c["commit"], c["date"], c["device"]) \
        == (1.0, 2.0, 2.5, 2.5, "abc1234", "2026-12-02", None)
    assert {c["status"] for c in pick(cs, kind="chain")} == {"not measured"}  # adaptive rows are no fixed budget


def test_L_is_capped_at_the_budgets_depth(tmp_path, monkeypatch):
    monkeypatch.setitem(cm.BUDGETS, "chain", dict(cm.CHAIN, max_depth=4))
    hybrid(tmp_path, "hybrid-m.json", "2026-12-01", "abc1234",
           [dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=5.0)])
    cs = pick(run(tmp_path), batch=1, kind="chain")
    assert [(c["status"], c["speedup"]) for c in cs] == [
        ("measured", 0.8), ("measured", 1.2), ("measured", 1.6), ("measured", 2.0), ("beyond depth", None),
        ("beyond depth", None)]
    assert "| **0.80x** | 1.20x | 1.60x | 2.00x | beyond depth | beyond depth |" in cm.table(cs)


def test_cells_without_a_measurement_at_their_batch_are_not_measured(tmp_path):
    hybrid(tmp_path, "hybrid-m.json", "2026-12-01", "abc1234", [
        dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=5.0),
        dict(B=1, row="SpecLA tree", ms_per_step=3.0, exact=0.5),  # outputs left plain decoding: no measurement
        dict(B=8, row="SpecLA chain", ms_per_step=5.0),  # no plain row at batch 8
        dict(B=16, **AR), dict(B=16, row="SpecLA tree", ms_per_step=4.0)])
    cs = run(tmp_path)
    status = {(c["batch"], c["kind"]): c["status"] for c in cs}
    assert status == {(1, "chain"): "measured", (1, "tree"): "not measured", (8, "chain"): "not measured",
                      (8, "tree"): "not measured", (16, "chain"): "not measured", (16, "tree"): "measured",
                      (32, "chain"): "not measured", (32, "tree"): "not measured", (64, "chain"): "not measured",
                      (64, "tree"): "not measured"}
    assert all(c["speedup"] is None and "t_ar_ms" not in c for c in cs if c["status"] == "not measured")
    table = cm.table(cs)
    assert "| 1 | tree | not measured | | | | | | | | |" in table
    assert "| 8 | chain, tree | not measured | | | | | | | | |" in table


def test_each_cell_comes_from_the_newest_report_measuring_it(tmp_path):
    hybrid(tmp_path, "hybrid-z-old.json", "2026-12-01", "abc1234",
           [dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=5.0), dict(B=8, **AR),
            dict(B=8, row="SpecLA chain", ms_per_step=5.0)])
    new = hybrid(tmp_path, "hybrid-a-new.json", "2026-12-02", "abc1234",
                 [dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=4.0)])
    cs = run(tmp_path)
    assert [(c["batch"], c["t_spec_ms"], Path(c["source"]).name) for c in pick(cs, kind="chain", L=1)
            if c["status"] == "measured"] == [(1, 4.0, new.name), (8, 5.0, "hybrid-z-old.json")]


def test_reports_of_one_date_are_ordered_by_their_commits(tmp_path):
    # two commits of this repository's history, 84f5894 made before b2b1fbd
    hybrid(tmp_path, "hybrid-later.json", "2026-12-04", "b2b1fbdd4bde49a1cb012692aaa2a34cc2e6d21c",
           [dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=4.0)])
    hybrid(tmp_path, "hybrid-earlier.json", "2026-12-04", "84f5894+dirty",
           [dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=5.0)])
    assert pick(run(tmp_path), batch=1, kind="chain", L=1)[0]["t_spec_ms"] == 4.0
    hybrid(tmp_path, "hybrid-unknown.json", "2026-12-04", "0000000",
           [dict(B=1, **AR), dict(B=1, row="SpecLA chain", ms_per_step=3.0)])
    with pytest.raises(ValueError, match=r"^m at batch 1 \(chain\): hybrid-earlier.json \(commit 84f5894\+dirty\), "
                                         r"hybrid-later.json .*, hybrid-unknown.json \(commit 0000000\) measured it on "
                                         r"2026-12-04 and their commits' order is unknown$"):
        run(tmp_path)


def test_the_plot_needs_matplotlib(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        cm.main(["--results", str(tmp_path), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: the plot needs matplotlib: pip install matplotlib (or pass --no-plot)\n")
    assert not (tmp_path / "out").exists()


def test_the_doc_and_the_json_hold_what_the_script_makes_of_the_committed_reports():
    cs = cm.cells(cm.select(cm.reports(ROOT / "benchmarks" / "results")))
    doc = (ROOT / "docs" / "cost-model.md").read_text()
    m = re.search(r"<!-- table: python benchmarks/cost_model.py -->\n\n(.*?)<!-- end of table -->", doc, re.S)
    assert m, "docs/cost-model.md lost its table markers"
    assert m.group(1) == cm.table(cs), "docs/cost-model.md: paste the table benchmarks/cost_model.py prints"
    committed = json.loads((ROOT / "benchmarks" / "results" / "cost-model" / "cost-model.json").read_text())
    assert committed["cells"] == cs, "benchmarks/results/cost-model/cost-model.json: run benchmarks/cost_model.py"
