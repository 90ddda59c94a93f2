"""Per-kernel GPU time of specla's recorded (CUDA-graph) steps at the GDN-1.3B shape (BENCHMARKS.md
section 5, the step-change table).

    python benchmarks/scripts/profile_step.py [--batches 1,64] [--tokens 64] [--rows 16] > prof.log

Uses ``benchmarks/e2e.py``'s model and oracle drafter (random weights, the embedding trick that
fixes the greedy continuation, a random EAGLE head's cost counted). For the AR step, the SpecLA
tree and the SpecLA chain (each at acceptance ``alpha = 0.8``) and each batch: the median wall time
per decoding step over 3 runs (prefill excluded), then one run under the torch profiler: CUDA
kernel time per step (prefill included), kernel launches per step and the profiler's table of the
``--rows`` costliest kernels. One CUDA GPU; FLA installed.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import CHAIN, TREE, Harness, geometric  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--batches", default="1,64")
p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
p.add_argument("--rows", type=int, default=16, help="kernels listed per profile table")
a = add_allow_dirty(p).parse_args()
if not torch.cuda.is_available():
    p.error("needs a CUDA GPU")
print_meta("cuda", a.allow_dirty)
args = argparse.Namespace(layers=24, embed_scale=32.0, batches=[int(x) for x in a.batches.split(",")], prompt_len=32,
                          eagle=True, tokens=a.tokens, repeats=3)
h = Harness(args)
for B in args.batches:
    for name, tree, prof in (("AR", dict(num_draft_tokens=0), None), ("tree", TREE, geometric(0.8, 6)),
                             ("chain", CHAIN, geometric(0.8, 6))):
        dec = h.decoder(tree, profile=prof)
        prompts = h.prompts[:B]
        dec.generate(prompts)  # warm-up: records the graphs
        walls = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = dec.generate(prompts)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t - r.stats.prefill_s) / r.stats.steps * 1e3)
        with profile(activities=[ProfilerActivity.CUDA]) as pr:
            r = dec.generate(prompts)
            torch.cuda.synchronize()
        ev = [e for e in pr.key_averages() if e.device_type.name == "CUDA"]
        tot = sum(e.self_device_time_total for e in ev)
        steps = r.stats.steps
        cnt = sum(e.count for e in ev)
        print(f"\n=== {name} B={B}: wall {statistics.median(walls):.3f} ms/step; kernels {tot / steps / 1e3:.3f} ms/step "
              f"(incl. prefill), {cnt / steps:.0f} launches/step, steps {steps}, "
              f"accepted {r.stats.mean_accepted_tokens:.2f}", flush=True)
        print(pr.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=70),
              flush=True)
        del dec
