"""Where a graph-captured speculative step of the ``small`` target's shape spends its time
(BENCHMARKS.md section 4, the float32 batch-32 diagnosis).

    python benchmarks/scripts/small_step_diag.py > diag.log

A randomly initialised GDN model of the ``small`` preset's shape (step cost in a CUDA graph does
not depend on acceptance), float32, batch 32, 128 new tokens, CUDA graphs. Rows: AR, ngram (N 8,
top-k 2), EAGLE chain (N 6) and tree (N 16, top-k 4) with a random attention head, and the tree
with an attention-free head (``num_heads=0``). Each row decodes 60-200-token prompts twice (warm-up,
timed) and 300-400-token prompts once, printing one JSON line per call: wall time, steps, prefill,
graphs recorded and their recording time, median and first step time. Then torch profiler tables
(by CUDA and by CPU time) of one EAGLE-tree and one ngram ``generate``. The run's ``meta``
(benchmarks/provenance.py) is the first line. One CUDA GPU; FLA installed.
"""
import argparse, sys, time, json, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import add_allow_dirty, print_meta
import fla  # noqa
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from train_target import PRESETS
from specla import SpecDecoder
from specla.drafters.eagle import EagleDrafter, EagleHead
import specla.cuda.graph_step as G

ap = add_allow_dirty(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
print_meta("cuda", ap.parse_args().allow_dirty)
torch.manual_seed(0)
m = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **PRESETS["small"]["model"])).cuda().float().eval()
g = torch.Generator().manual_seed(0)
def make(lo, hi):
    return [torch.randint(0, 32000, (int(n),), generator=g).tolist() for n in torch.randint(lo, hi, (32,), generator=g)]
prompts, longer = make(60, 200), make(300, 400)
rec = {"n": 0, "s": 0.0}
orig_new = G.GraphRunner._new_graph
def wrap(self, *a, **k):
    torch.cuda.synchronize(); t = time.perf_counter(); out = orig_new(self, *a, **k); torch.cuda.synchronize()
    rec["n"] += 1; rec["s"] += time.perf_counter() - t; return out
G.GraphRunner._new_graph = wrap
times = []
orig_step = G.GraphRunner.step
def tstep(self, contexts):
    t = time.perf_counter(); r = orig_step(self, contexts); times.append(time.perf_counter() - t); return r
G.GraphRunner.step = tstep
rows = {"ar": (None, dict(num_draft_tokens=0)),
        "ngram": ("ngram", dict(num_draft_tokens=8, max_depth=6, top_k=2)),
        "eagle-chain": ("eagle", dict(num_draft_tokens=6, max_depth=6, top_k=1)),
        "eagle-tree": ("eagle", dict(num_draft_tokens=16, max_depth=6, top_k=4)),
        "eagle0-tree": ("eagle0", dict(num_draft_tokens=16, max_depth=6, top_k=4))}
decs = {}
for name, (dr, tree) in rows.items():
    drafter = {"eagle": lambda: EagleDrafter(EagleHead(768)), "eagle0": lambda: EagleDrafter(EagleHead(768, num_heads=0))}.get(dr, lambda: dr or "ngram")()
    dec = decs[name] = SpecDecoder(m, "gdn", drafter=drafter, config=dict(dtype="float32", device="cuda", max_new_tokens=128, stop_at_eos=False, **tree))
    for ps, label in ((prompts, "warm"), (prompts, "timed"), (longer, "longer-prompts")):
        rec.update(n=0, s=0.0); times.clear()
        torch.cuda.synchronize(); t = time.perf_counter(); r = dec.generate(ps); torch.cuda.synchronize(); wall = time.perf_counter() - t
        st = sorted(times)
        print(json.dumps(dict(row=name, call=label, wall_s=round(wall, 3), steps=r.stats.steps, prefill_s=round(r.stats.prefill_s, 3),
              graphs_recorded=rec["n"], record_s=round(rec["s"], 3), step_ms_median=round(1e3 * st[len(st) // 2], 3),
              step_ms_first=round(1e3 * times[0], 1), tokens=r.stats.generated_tokens)), flush=True)
from torch.profiler import profile, ProfilerActivity
for name in ("eagle-tree", "ngram"):
    dec = decs[name]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dec.generate(prompts); torch.cuda.synchronize()
    print(f"== {name}: whole generate (128 steps), by self CUDA time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70))
    print(f"== {name}: by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))
