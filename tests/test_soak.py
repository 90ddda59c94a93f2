"""Soak: 8,192 greedy tokens from the bundled trained tiny target (float32, CPU), speculative and
autoregressive outputs identical token for token (issue 7: no drift over long decoding)."""

import json
from pathlib import Path

import pytest
import torch

import specla
from specla.registry import get_plugin


@pytest.mark.slow
def test_8192_tokens_speculative_equals_autoregressive():
    arch = get_plugin("gdn")
    model = arch.load_model(arch.demo_checkpoint, dtype=torch.float32, device="cpu")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(arch.demo_checkpoint))
    rows = (Path(specla.__file__).parent / "data" / "demo_prompts.jsonl").read_text().splitlines()
    prompt = tok(json.loads(rows[0])["prompt"], add_special_tokens=False)["input_ids"]
    cfg = dict(max_new_tokens=8192, stop_at_eos=False, num_draft_tokens=8, max_depth=6, top_k=2)
    spec = specla.run(model, "gdn", prompts=[prompt], config=cfg)
    ar = specla.run(model, "gdn", prompts=[prompt], config={**cfg, "num_draft_tokens": 0})
    assert len(spec.outputs[0]) == len(ar.outputs[0]) == 8192
    first_diff = next((i for i, (a, b) in enumerate(zip(spec.outputs[0], ar.outputs[0])) if a != b), None)
    assert first_diff is None, f"outputs diverge at token {first_diff}"
    assert spec.stats.mean_accepted_tokens > 1  # speculation really ran
