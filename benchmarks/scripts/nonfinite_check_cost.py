"""What the per-step check for non-finite logits (``specla.step.nonfinite_rows``) costs on the CPU.

    python benchmarks/scripts/nonfinite_check_cost.py [--runs 7] [--new-tokens 32]

The demo target (the tiny GDN target in Qwen3.5 form; float32, PyTorch reference kernels, one thread),
greedy speculative decoding with the ngram drafter (8 draft tokens, depth 8, chains), batches 1 and
32 of the bundled demo prompts (cycled), no stop at EOS, fixed budget. A step's time is a call's
decode time (wall minus prefill) over its steps. "without" replaces ``nonfinite_rows`` with a
function that returns all-False flags (the outcome still carries the flag column: one int64 per
row in the same transfer). The two forms run
alternately, one warm-up call each, then ``--runs`` timed calls each. Step times on a shared
machine vary by more than the check costs, so the check is also timed alone: ``nonfinite_rows`` on
random logits of a step's shape ``[B, N + 1, vocab]`` (median of 200 calls). Prints one JSON line
with the medians in milliseconds and torch's version.
"""

import argparse
import json
import statistics
import time

import torch

import specla.step
from specla import SpecDecoder
from specla.apps.demo import default_checkpoint, demo_prompts


def step_ms(dec: SpecDecoder, prompts: list[list[int]]) -> float:
    stats = dec.generate(prompts).stats
    return 1e3 * (stats.wall_s - stats.prefill_s) / stats.steps


def check_ms(batch: int, nodes: int, vocab: int, calls: int = 200) -> float:
    """Median time of ``nonfinite_rows`` alone on ``[batch, nodes, vocab]`` float32 logits and a
    whole-chain path."""
    logits = torch.randn(batch, nodes, vocab)
    path = torch.arange(nodes).expand(batch, nodes)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        specla.step.nonfinite_rows(logits, path)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checked = specla.step.nonfinite_rows

    def unchecked(logits, path):
        return torch.zeros(path.shape[0], dtype=torch.bool, device=path.device)

    cfg = dict(device="cpu", dtype="float32", num_draft_tokens=8, max_depth=8, top_k=1,
               max_new_tokens=args.new_tokens, stop_at_eos=False,
               engine=dict(kernels="reference", budget_policy="fixed"))
    plugin, path = default_checkpoint()
    dec = SpecDecoder(path, plugin, drafter="ngram", config=cfg)
    texts = [row["prompt"] for row in demo_prompts()]
    result = {"torch": torch.__version__, "runs": args.runs, "new_tokens": args.new_tokens}
    for batch in (1, 32):
        prompts = dec.encode([texts[i % len(texts)] for i in range(batch)])
        times = {"with": [], "without": []}
        for timed in range(args.runs + 1):
            for form, flag in (("with", checked), ("without", unchecked)):
                specla.step.nonfinite_rows = flag
                t = step_ms(dec, prompts)
                if timed:  # the first call of each form warms up
                    times[form].append(t)
        specla.step.nonfinite_rows = checked
        w, wo = statistics.median(times["with"]), statistics.median(times["without"])
        alone = check_ms(batch, cfg["num_draft_tokens"] + 1, dec.adapter.vocab_size)
        result[f"batch{batch}"] = {"step_ms_with": round(w, 3), "step_ms_without": round(wo, 3),
                                   "overhead_pct": round(100 * (w - wo) / wo, 2), "check_alone_ms": round(alone, 4),
                                   "check_alone_pct_of_step": round(100 * alone / wo, 3),
                                   "with_all": [round(x, 3) for x in times["with"]],
                                   "without_all": [round(x, 3) for x in times["without"]]}
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
