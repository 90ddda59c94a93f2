"""specla bench: task checks and the side-by-side report (tiny target, bundled prompts)."""

import json
import subprocess
import sys
from importlib import resources

import pytest

from specla import SpecConfig
from specla.bench import format_table, gsm8k_answer, humaneval_passes, load_prompts, run_bench
from specla.registry import get_plugin

TINY = get_plugin("gdn").demo_checkpoint
DATA = str(resources.files("specla").joinpath("data/demo_prompts.jsonl"))


@pytest.mark.parametrize(
    "text, expected",
    [("She makes 9 * 2 = $18.\n#### 18", "18"), (" 1,234 apples\nthen 5", "1234"), ("no number", None),
     (" The answer is 7.\nQuestion: 12", "7"), ("#### -3.5", "-3.5")],
)
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


def test_humaneval_execution():
    row = [r for r in load_prompts(DATA) if r["category"] == "humaneval"][0]
    assert humaneval_passes(row, row["canonical_solution"]) is True
    assert humaneval_passes(row, "    return None\n") is False
    assert humaneval_passes(row, "    while True:\n        pass\n", timeout_s=2) is False


def test_bench_report_is_side_by_side_and_exact():
    cfg = SpecConfig(max_new_tokens=24, dtype="float32", top_k=2)
    report = run_bench(TINY, "ngram", DATA, config=cfg, limit=6, batch_size=2)
    cats = report["categories"]
    assert set(cats) == {"gsm8k", "humaneval", "all"}
    for c in cats.values():
        assert c["exact_match_rate"] == 1.0
        assert c["tokens_per_s"] > 0 and c["speedup"] == pytest.approx(c["tokens_per_s"] / c["ar_tokens_per_s"])
    assert cats["all"]["prompts"] == 6
    for task in ("gsm8k_accuracy", "humaneval_pass_at_1"):
        cat = cats["gsm8k" if task.startswith("gsm8k") else "humaneval"][task]
        assert cat["n"] == 3 and cat["speculative"] == cat["autoregressive"]  # exact outputs, same scores
    assert "gsm8k_accuracy" in format_table(report)


def test_bench_cli(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "specla.cli", "bench", "--model", str(TINY), "--prompts", DATA,
                           "--limit", "2", "--max-new-tokens", "8", "--device", "cpu", "--out", str(out),
                           "--config", '{"dtype": "float32"}'], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "speedup" in proc.stdout and json.loads(out.read_text())["categories"]["all"]["prompts"] == 2
