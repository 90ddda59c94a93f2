"""Eager engine step cost on a GPU, PyTorch reference path against the Triton kernels (BENCHMARKS.md
section 3).

    python benchmarks/scripts/eager_step_probe.py OUT_DIR

A randomly initialised GDN model of the ``small`` preset's shape (hidden 768, 12 layers, 4 heads
of 128, expand_v 2, vocab 32,000), 100-token random prompts, 48 new tokens, ``SpecDecoder`` with
CUDA graphs off. For float32 and bfloat16, each kernel path and batches 1 and 32: an
autoregressive step (N = 0, ngram drafter) and a verify of a 16-draft chain whose drafts are all
wrong (``OracleDrafter`` pattern ``none``: every step verifies 17 nodes and commits one token).
Two warm-up runs, then one timed run; prints the run's ``meta`` (benchmarks/provenance.py) and one
JSON line per configuration, writes them to ``OUT_DIR/e2e-probe.json`` (``meta`` and ``rows``) and
torch profiler tables of float32, batch 32, N = 16 to
``OUT_DIR/prof-{reference,triton}-float32-B32-N16.txt``. One CUDA GPU; FLA installed.
"""
import argparse, json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import add_allow_dirty, print_meta
import fla  # noqa
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from specla import SpecConfig
from specla.api import SpecDecoder
from specla.testing.drafters import OracleDrafter

ap = add_allow_dirty(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
ap.add_argument("out", metavar="OUT_DIR")
a = ap.parse_args()
out = a.out
meta = print_meta("cuda", a.allow_dirty)
Path(out).mkdir(parents=True, exist_ok=True)
cfg = GatedDeltaNetConfig(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_heads=4, head_dim=128,
                          expand_v=2, tie_word_embeddings=True)
torch.manual_seed(0)
model = GatedDeltaNetForCausalLM(cfg).cuda().float()
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 32000, (100,), generator=g).tolist() for _ in range(32)]
conts = [torch.randint(0, 32000, (200,), generator=g).tolist() for _ in range(32)]
rows = []
def run(dtype, kernels, B, N, profile=False):
    sc = SpecConfig(device="cuda", dtype=dtype, num_draft_tokens=N, max_depth=max(N, 1), top_k=1,
                    max_new_tokens=48, stop_at_eos=False,
                    engine=dict(kernels=kernels, cuda_graphs="off", budget_policy="fixed"))
    drafter = OracleDrafter(prompts[:B], conts[:B], "none", 32000) if N else "ngram"
    dec = SpecDecoder(model, "gdn", drafter=drafter, config=sc)
    dec.generate(prompts[:B]); dec.generate(prompts[:B])  # warm-up, compile
    torch.cuda.synchronize(); t = time.perf_counter()
    r = dec.generate(prompts[:B]); torch.cuda.synchronize(); dt = time.perf_counter() - t
    row = dict(dtype=dtype, kernels=kernels, B=B, N=N, s=round(dt, 3), steps=r.stats.steps,
               ms_per_step=round(dt / r.stats.steps * 1e3, 2))
    rows.append(row); print(json.dumps(row), flush=True)
    if profile:
        from torch.profiler import profile as prof, ProfilerActivity
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            dec.generate(prompts[:B]); torch.cuda.synchronize()
        with open(f"{out}/prof-{kernels}-{dtype}-B{B}-N{N}.txt", "w") as f:
            f.write(p.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=20))
for dtype in ("float32", "bfloat16"):
    for kernels in ("reference", "triton"):
        for B in (1, 32):
            for N in (0, 16):
                run(dtype, kernels, B, N, profile=(dtype == "float32" and B == 32 and N == 16))
json.dump(dict(meta=meta, rows=rows), open(f"{out}/e2e-probe.json", "w"), indent=1)
