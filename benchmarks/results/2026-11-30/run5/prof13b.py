"""Per-kernel GPU time of specla's recorded steps at the GDN-1.3B shape (dev tool).
Variants: default; ar-serial (T = 1 recorded verify on the serial kernel); no-overlap (steps not queued ahead)."""
import argparse, sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
from e2e import Harness, TREE, CHAIN, geometric
from torch.profiler import profile, ProfilerActivity
from specla.layerwise import LayerwiseAdapter
from specla.graphs import GraphRunner
p = argparse.ArgumentParser(); p.add_argument("--batches", default="1,64"); p.add_argument("--tokens", type=int, default=64)
p.add_argument("--variant", default="default"); p.add_argument("--rows", type=int, default=16)
a = p.parse_args()
if a.variant == "ar-serial":
    orig = LayerwiseAdapter._kernel_choice
    LayerwiseAdapter._kernel_choice = lambda self, pick, parents, counts: (
        "serial" if self.static_shapes and parents.shape[1] == 1 else orig(self, pick, parents, counts))
if a.variant == "no-overlap":
    GraphRunner.overlaps = property(lambda self: False)
args = argparse.Namespace(layers=24, embed_scale=32.0, batches=[int(x) for x in a.batches.split(",")], prompt_len=32,
                          eagle=True, tokens=a.tokens, repeats=3)
h = Harness(args)
for B in args.batches:
    for name, tree, prof in (("AR", dict(num_draft_tokens=0), None), ("tree", TREE, geometric(0.8, 6)),
                             ("chain", CHAIN, geometric(0.8, 6))):
        dec = h.decoder(tree, profile=prof)
        prompts = h.prompts[:B]
        dec.generate(prompts)
        walls = []
        for _ in range(3):
            torch.cuda.synchronize(); t = time.perf_counter(); r = dec.generate(prompts); torch.cuda.synchronize()
            walls.append((time.perf_counter() - t - r.stats.prefill_s) / r.stats.steps * 1e3)
        with profile(activities=[ProfilerActivity.CUDA]) as pr:
            r = dec.generate(prompts); torch.cuda.synchronize()
        ev = [e for e in pr.key_averages() if e.device_type.name == "CUDA"]
        tot = sum(e.self_device_time_total for e in ev)
        steps = r.stats.steps
        cnt = sum(e.count for e in ev)
        print(f"\n=== {a.variant} {name} B={B}: wall {statistics.median(walls):.3f} ms/step; kernels {tot/steps/1e3:.3f} ms/step "
              f"(incl. prefill), {cnt/steps:.0f} launches/step, steps {steps}, accepted {r.stats.mean_accepted_tokens:.2f}", flush=True)
        print(pr.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=70), flush=True)
        del dec
