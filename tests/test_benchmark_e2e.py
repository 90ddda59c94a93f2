"""The CPU-checkable parts of ``benchmarks/e2e.py`` (the GDN-1.3B study itself needs a GPU): the
oracle drafter's acceptance follows its profile, greedy output stays exact with and without the
fixed-shape (graph) step, measured profiles are read as they were recorded, and the tables say
"not run" for missing cells instead of failing."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from specla import SpecConfig
from specla.api import SpecDecoder
from specla.registry import get_plugin

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_oracle_drafter_follows_its_profile_and_output_is_exact(margin_model, graphs):
    alpha, D = 0.8, 6
    torch.manual_seed(0)
    cfg = SpecConfig(num_draft_tokens=16, max_depth=D, top_k=4, cuda_graphs=graphs, max_new_tokens=300,
                     stop_at_eos=False)
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


def test_tables_mark_cells_that_were_not_run():
    rows = [dict(study="step", N=0, B=1, ms_per_step=3.0, vs_ar_step=1.0),
            dict(study="step", N=16, B=1, ms_per_step=4.9, vs_ar_step=1.63),
            dict(study="step", N=0, B=8, ms_per_step=4.4, vs_ar_step=1.0)]
    text = e2e.tables(rows)
    assert "| 1 | 3.000 (1.00x) | 4.900 (1.63x) |" in text and "| 8 | 4.400 (1.00x) | not run |" in text
