"""Soak: 8,192 greedy tokens from the bundled trained tiny target (float32, CPU), speculative and
autoregressive outputs identical token for token (issue 7: no drift over long decoding)."""

import json
from pathlib import Path

import pytest
import torch

import specla
from specla.registry import get_plugin
from specla_fla.plugin import TINY_TARGET


@pytest.mark.slow
def test_8192_tokens_speculative_equals_autoregressive():
    arch = get_plugin("gdn")
    model = arch.load_model(TINY_TARGET, dtype=torch.float32, device="cpu")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_TARGET))
    rows = (Path(specla.__file__).parent / "apps" / "data" / "demo_prompts.jsonl").read_text().splitlines()
    prompt = tok(json.loads(rows[0])["prompt"], add_special_tokens=False)["input_ids"]
    cfg = dict(max_new_tokens=8192, stop_at_eos=False, num_draft_tokens=8, max_depth=6, top_k=2)
    spec = specla.run(model, "gdn", prompts=[prompt], config=cfg)
    ar = specla.run(model, "gdn", prompts=[prompt], config={**cfg, "num_draft_tokens": 0})
    assert len(spec.outputs[0]) == len(ar.outputs[0]) == 8192
    first_diff = next((i for i, (a, b) in enumerate(zip(spec.outputs[0], ar.outputs[0])) if a != b), None)
    assert first_diff is None, f"outputs diverge at token {first_diff}"
    assert spec.stats.mean_accepted_tokens > 1  # speculation really ran


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_8192_tokens_on_gpu_float32_identical_and_bf16_reported():
    """On the GPU with the default kernels (Triton): float32 speculative output stays identical to
    autoregressive output over 8,192 tokens; in bfloat16 the run completes with finite logits and
    its agreement with bf16 autoregressive decoding is printed (issue 7 asks for the rate, not
    identity: bf16 rounding differs between a tree pass and a one-token pass)."""
    arch = get_plugin("gdn")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_TARGET))
    rows = (Path(specla.__file__).parent / "apps" / "data" / "demo_prompts.jsonl").read_text().splitlines()
    prompts = [tok(json.loads(r)["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:4]]
    # fixed: the recorded figures come from one timing-free schedule
    cfg = dict(max_new_tokens=8192, stop_at_eos=False, num_draft_tokens=8, max_depth=6, top_k=2, device="cuda",
               engine=dict(budget_policy="fixed"))
    report = {}
    for dtype in ("float32", "bfloat16"):
        model = arch.load_model(TINY_TARGET, dtype=getattr(torch, dtype), device="cuda")
        spec = specla.run(model, "gdn", prompts=prompts, config={**cfg, "dtype": dtype})
        ar = specla.run(model, "gdn", prompts=prompts, config={**cfg, "dtype": dtype, "num_draft_tokens": 0})
        assert all(len(o) == 8192 for o in spec.outputs + ar.outputs)
        first = [next((i for i, (a, b) in enumerate(zip(s, r)) if a != b), 8192) for s, r in zip(spec.outputs, ar.outputs)]
        report[dtype] = {"identical_sequences": sum(f == 8192 for f in first), "of": len(first),
                         "first_divergence": first, "mean_accepted": spec.stats.mean_accepted_tokens}
        if dtype == "float32":
            assert first == [8192] * len(first), f"float32 outputs diverge at {first}"
    print(json.dumps(report))  # the bf16 rate, for the run's record
