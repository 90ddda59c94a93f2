"""``benchmarks/acceptance.py``'s run names: each modifier sets what it says, and a wrong name is
refused before anything loads."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("acceptance_bench", ROOT / "benchmarks" / "acceptance.py")
acceptance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(acceptance)
BASE = dict(max_new_tokens=128, dtype="float32", device="cpu")


def test_run_names_and_modifiers():
    suite, kind, cfg = acceptance.run_config("gsm8k/eagle-tree", BASE)
    assert (suite, kind, cfg.num_draft_tokens, cfg.top_k, cfg.engine.budget_policy) == (
        "gsm8k_test.jsonl", "eagle", 16, 4, "fixed")
    _, _, cfg = acceptance.run_config("mixed/eagle-tree/n15/auto/bf16/t0.7", BASE)
    assert (cfg.num_draft_tokens, cfg.engine.budget_policy, cfg.dtype, cfg.temperature, cfg.seed) == (
        15, "auto", "bfloat16", 0.7, 0)
    assert acceptance.run_config("humaneval/ngram/reference", BASE)[2].engine.kernels == "reference"


@pytest.mark.parametrize("name,match", [("gsm8k/eagle-tree/n", "unknown run modifier 'n'"),
                                        ("gsm8k/eagle-tree/fast", "unknown run modifier 'fast'"),
                                        ("nope/eagle-tree", "expected SUITE/DRAFTER")])
def test_wrong_run_names_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        acceptance.run_config(name, BASE)
