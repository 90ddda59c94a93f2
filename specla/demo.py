"""``specla demo``: the main job on the embedded default target, with a side-by-side
autoregressive baseline in the same run."""

from __future__ import annotations

import json
import time
from importlib import resources

import torch

from . import registry
from .api import SpecDecoder
from .config import SpecConfig


def demo_prompts() -> list[dict]:
    """The bundled prompts (``specla/data/demo_prompts.jsonl``): ``id``, ``category``, ``prompt``."""
    text = resources.files("specla").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def default_checkpoint() -> tuple[str, object]:
    """``(plugin name, checkpoint dir)`` of the first registered plugin that ships a demo model.

    Raises:
        RuntimeError: no installed plugin ships one.
    """
    for name in registry.available():
        path = registry.get_plugin(name).demo_checkpoint
        if path is not None:
            return name, path
    raise RuntimeError("no installed plugin ships a demo checkpoint")


def run_demo(device: str | None = None, max_new_tokens: int = 96, drafter: str = "ngram", echo=print) -> dict:
    """Decode the bundled prompts speculatively and autoregressively (batch 1, float32), print each
    generation, and return the summary figures.

    Args:
        device: ``cpu``/``cuda``; ``None`` picks CUDA when available.
        max_new_tokens: tokens per prompt.
        drafter: ``ngram`` (the default: on the tiny target it accepts more than the shipped
            EAGLE drafter, docs/targets.md), ``eagle`` (the drafter shipped with the demo
            target), or a drafter directory.
        echo: where lines go (``print``).
    Returns:
        ``exact_match`` (speculative == autoregressive tokens for every prompt),
        ``mean_accepted_tokens`` (drafts accepted per step), ``tokens_per_s`` and
        ``ar_tokens_per_s`` (generated tokens over decode wall time, prefill included, batch 1),
        ``speedup`` (their ratio), ``device``, ``plugin``, ``prompts``.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plugin, path = default_checkpoint()
    drafter_arg = registry.get_plugin(plugin).demo_drafters.get(drafter, drafter)
    cfg = SpecConfig(num_draft_tokens=8, max_depth=6, top_k=2, max_new_tokens=max_new_tokens,
                     dtype="float32", device=device)
    spec = SpecDecoder(path, plugin, drafter=str(drafter_arg), config=cfg)
    ar = SpecDecoder(spec.model, plugin, config=cfg.model_copy(update={"num_draft_tokens": 0}),
                     tokenizer=spec.tokenizer)
    rows = demo_prompts()
    spec.generate([rows[0]["prompt"]])  # warm-up: first-call allocations stay out of the timing
    ar.generate([rows[0]["prompt"]])
    totals = {"spec_s": 0.0, "ar_s": 0.0, "tokens": 0, "ar_tokens": 0, "accepted": 0, "steps": 0}
    exact = True
    for row in rows:
        t = time.perf_counter()
        s = spec.generate([row["prompt"]])
        totals["spec_s"] += time.perf_counter() - t
        t = time.perf_counter()
        a = ar.generate([row["prompt"]])
        totals["ar_s"] += time.perf_counter() - t
        exact &= s.outputs == a.outputs
        totals["tokens"] += s.stats.generated_tokens
        totals["ar_tokens"] += a.stats.generated_tokens
        totals["accepted"] += sum(k * n for k, n in enumerate(s.stats.accepted_histogram))
        totals["steps"] += s.stats.sequence_steps
        echo(f"=== {row['id']} ({row['category']}) " + "=" * 30)
        echo(row["prompt"].rstrip()[-300:])
        echo(f"--- generated ({s.stats.generated_tokens} tokens, {s.stats.tokens_per_step:.2f} per step):")
        echo(s.texts[0])
    tps, ar_tps = totals["tokens"] / totals["spec_s"], totals["ar_tokens"] / totals["ar_s"]
    return {
        "exact_match": bool(exact),
        "mean_accepted_tokens": totals["accepted"] / max(totals["steps"], 1),
        "tokens_per_s": tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": tps / ar_tps,
        "device": device,
        "plugin": plugin,
        "drafter": drafter,
        "prompts": len(rows),
    }
