"""How torch's CPU thread pool changes specla's speed on a CPU: the demo target decoded with
``torch.set_num_threads(n)`` for each ``n`` asked, speculative (n-gram drafter) and plain, float32,
batch 1, prefill included.

    python benchmarks/scripts/cpu_threads.py --threads 1,2 --repeats 3 [--busy 2] > threads.json

``--busy K`` starts K processes that spin on the CPU for the whole run, as other work on a shared
machine would. Prints one JSON object: ``meta`` (benchmarks/provenance.py, the spinning processes and
the 1-minute load average at the end, which counts work outside the run too) and per thread count the
median and every repeat's tokens/s of both decodes, and the speedup of the medians.
"""
import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import add_allow_dirty, provenance  # noqa: E402

import specla  # noqa: E402
from specla.apps.demo import default_checkpoint, demo_prompts  # noqa: E402


def spin() -> None:
    while True:
        pass


def tokens_per_s(dec: specla.SpecDecoder, prompts: list[str]) -> float:
    t, n = time.perf_counter(), 0
    for p in prompts:
        n += dec.generate([p]).stats.generated_tokens
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="CPU-spinning processes beside the run")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = add_allow_dirty(ap).parse_args()
    meta = provenance("cpu", args.allow_dirty)  # before anything runs: the tree may change while the run lasts
    plugin, path = default_checkpoint()
    prompts = [r["prompt"] for r in demo_prompts()]
    cfg = dict(max_new_tokens=args.max_new_tokens, dtype="float32", device="cpu", num_draft_tokens=8, max_depth=6,
               top_k=2)
    spec = specla.SpecDecoder(path, plugin, config=cfg)
    plain = specla.SpecDecoder(spec.model, plugin, config={**cfg, "num_draft_tokens": 0}, tokenizer=spec.tokenizer)
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    rows = {}
    try:
        for n in map(int, args.threads.split(",")):
            torch.set_num_threads(n)
            tokens_per_s(spec, prompts[:1]), tokens_per_s(plain, prompts[:1])  # warm-up
            runs = [(tokens_per_s(spec, prompts), tokens_per_s(plain, prompts)) for _ in range(args.repeats)]
            s, a = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            rows[n] = dict(spec_tokens_per_s=s, plain_tokens_per_s=a, speedup=s / a, runs=runs)
    finally:
        for p in busy:
            p.terminate()
    meta.update(busy=args.busy, load_average_1min=os.getloadavg()[0], plugin=plugin, config=cfg)
    print(json.dumps(dict(meta=meta, threads=rows),
                     indent=1))


if __name__ == "__main__":
    main()
