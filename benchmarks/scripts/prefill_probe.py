"""Where a speculative call's prefill spends more than a plain call's, over prompts of many
lengths (BENCHMARKS.md section 4, issue 16's target 1).

    python benchmarks/scripts/prefill_probe.py [--lengths 48] [--pair-pass 256 --pair-round 64] > probe.jsonl

``specla bench`` decodes a suite whose prompts have many lengths, and its warm-up sees only the
longest prompt and each batch size's first batch; a part of the prefill whose shapes follow the
prompt length meets most lengths for the first time inside a timed call. This probe takes a
randomly initialised GDN model of the ``small`` preset's shape with a random EAGLE head (CUDA
graphs, bfloat16), warms both decoders up on one 69-token prompt, then for ``--lengths``
distinct prompt lengths (20 to 400 tokens, shuffled) times, per prompt and CUDA synchronised, the
target's prompt passes (``adapter.prefill``) and the drafter's reset, for the plain decoder (N 0)
and the EAGLE tree (N 15), interleaved; then the same prompts again (every length seen once).
One JSON line per (row, pass) with the medians and means in ms, then one with the host
operators of a drafter reset at a prompt length not seen before (torch profiler, most self CPU
time first; its GEMM shapes are new only with one pass of the prompt's own width).

``--pair-pass``, ``--pair-round``: the most pairs the drafter's reset takes in one pass over the
prompt pairs, and what a shorter pass's width is rounded up to (:data:`specla.drafters.eagle.
PAIR_PASS` and ``PAIR_ROUND``; ``--pair-pass 100000 --pair-round 1``: one pass of the prompt's
own width). One CUDA GPU; FLA installed.
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402
from step_anatomy import ROWS as ANATOMY_ROWS  # noqa: E402
from train_target import PRESETS  # noqa: E402

from specla import SpecDecoder  # noqa: E402
import specla.drafters.eagle as eagle  # noqa: E402

ROWS = {name: ANATOMY_ROWS[name] for name in ("ar", "eagle-tree")}  # step_anatomy.py's budgets


def timed_prefill(dec, prompt):
    """``(adapter.prefill ms, drafter reset ms)`` of one prompt, CUDA synchronised."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    dec.adapter.prefill([prompt])
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    dec.drafter.reset([prompt])
    torch.cuda.synchronize()
    return (t1 - t) * 1e3, (time.perf_counter() - t1) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, default=48)
    p.add_argument("--pair-pass", type=int, default=eagle.PAIR_PASS)
    p.add_argument("--pair-round", type=int, default=eagle.PAIR_ROUND)
    a = add_allow_dirty(p).parse_args()
    print_meta("cuda", a.allow_dirty)
    eagle.PAIR_PASS, eagle.PAIR_ROUND = a.pair_pass, a.pair_round
    torch.manual_seed(0)
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **PRESETS["small"]["model"]))
    model = model.to("cuda", torch.bfloat16).eval()
    head = eagle.EagleHead(model.config.hidden_size)
    rng = random.Random(0)
    lengths = rng.sample(range(20, 401), a.lengths)
    prompts = [[rng.randrange(32000) for _ in range(n)] for n in lengths]
    decs = {}
    for name, tree in ROWS.items():
        drafter = eagle.EagleDrafter(head) if tree["num_draft_tokens"] else "ngram"
        decs[name] = SpecDecoder(model, "gdn", drafter=drafter, config=dict(
            dtype="bfloat16", device="cuda", max_new_tokens=128, stop_at_eos=False,
            engine=dict(cuda_graphs="on", budget_policy="fixed"), **tree))
        decs[name].generate([[rng.randrange(32000) for _ in range(69)]])  # graphs and kernels warm
        decs[name].generate([max(prompts, key=len)])  # caches sized for the longest, as bench's warm-up
    for pass_ in ("first", "repeat"):
        times = {name: ([], []) for name in ROWS}
        for prompt in prompts:
            for name, dec in decs.items():
                pre, reset = timed_prefill(dec, prompt)
                times[name][0].append(pre)
                times[name][1].append(reset)
        for name, (pre, reset) in times.items():
            print(json.dumps(dict(row=name, pass_=pass_, pair_pass=a.pair_pass, pair_round=a.pair_round, prompts=len(prompts),
                                  adapter_prefill_ms=dict(median=round(statistics.median(pre), 3),
                                                          mean=round(statistics.mean(pre), 3)),
                                  drafter_reset_ms=dict(median=round(statistics.median(reset), 3),
                                                        mean=round(statistics.mean(reset), 3), max=round(max(reset), 3)))),
                  flush=True)
    dec = decs["eagle-tree"]
    fresh = 1000 + a.pair_round // 2  # a length no pass has seen (a new width only with one pass of its own width)
    prompt = [rng.randrange(32000) for _ in range(fresh)]
    dec.adapter.prefill([prompt])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dec.drafter.reset([prompt])
        torch.cuda.synchronize()
    host = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    print(json.dumps(dict(row="eagle-tree", first_seen_reset_host_ops=[
        [e.key[:60], e.count, round(e.self_cpu_time_total, 1)] for e in host[:15]])), flush=True)


if __name__ == "__main__":
    main()
