"""Diagnostic: per-step engine cost, reference vs triton kernels, random-weight small-shape GDN."""
import json, sys, time
import torch
import fla  # noqa
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
from specla import SpecConfig
from specla.api import SpecDecoder
from specla.testing.drafters import OracleDrafter

out = sys.argv[1]
cfg = GatedDeltaNetConfig(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_heads=4, head_dim=128,
                          expand_v=2, tie_word_embeddings=True)
torch.manual_seed(0)
model = GatedDeltaNetForCausalLM(cfg).cuda().float()
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 32000, (100,), generator=g).tolist() for _ in range(32)]
conts = [torch.randint(0, 32000, (200,), generator=g).tolist() for _ in range(32)]
rows = []
def run(dtype, kernels, B, N, profile=False):
    sc = SpecConfig(device="cuda", dtype=dtype, kernels=kernels, num_draft_tokens=N, max_depth=max(N, 1), top_k=1,
                    max_new_tokens=48, stop_at_eos=False)
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
json.dump(rows, open(f"{out}/e2e-probe.json", "w"), indent=1)
