"""Where a ``generate`` call of the ``small`` target's shape spends its time, part by part
(BENCHMARKS.md section 4, issue 16's diagnosis).

    python benchmarks/scripts/step_anatomy.py [--batches 1,32] [--dtype bfloat16] > anatomy.jsonl

A randomly initialised GDN model of the ``small`` preset's shape (``--preset``: another; costs in
a CUDA graph do not depend on acceptance) with a random attention EAGLE head, prompts of 69
tokens (the GSM8K suite's median), 128 new tokens, CUDA graphs. Rows: AR (N 0), EAGLE chain (N 6) and tree (N 15, depth 6,
top-k 4). For each row and batch, one JSON line with

- the whole call (medians of 5 after a warm-up call that records the graphs): wall ms, prefill
  (prompt passes and the drafter's reset), the first step, the median graph step, the final flush;
- each part of a step recorded alone in its own CUDA graph and replayed 50 times: the drafter's
  tree (``propose``), ``verify`` with the pending commit fused, ``accept + commit`` (greedy
  acceptance, the pending commit's bookkeeping, the drafter's cache update), and the whole
  recorded step; device time per replay (ms) and kernels per replay (torch profiler); with
  ``--kernel-names``, each part's kernels by name (launches and device µs in one replay);
- ``prefill`` (with ``--prefill``): the prefill's two halves timed alone (medians of 5, CUDA
  synchronised): the target's prompt passes (``adapter.prefill``) and the drafter's reset, and
  one of each profiled: kernels, their device µs, and the host operators with the most self CPU
  time (what a prefill is bound by when its device time is below its wall time);
- ``fla-graph``: FLA's own ``GatedDeltaNetForCausalLM`` forward of one token with its cache,
  recorded in a CUDA graph (the plain-decoding baseline of the measuring protocol).

One CUDA GPU; FLA installed.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import GDN13B_SHAPE, fla_graph_step, graph_time  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402
from train_target import PRESETS  # noqa: E402

from specla import SpecDecoder  # noqa: E402
from specla.acceptance import accept_greedy  # noqa: E402
from specla.drafters.eagle import EagleDrafter, EagleHead  # noqa: E402
import specla.cuda.graph_step as G  # noqa: E402
from specla.tree import DraftTree  # noqa: E402

CUDA = True  # set by --device
NAMES = False  # set by --kernel-names
KERNEL_NAMES: dict[int, dict] = {}  # per timed graph, in order: kernel name -> [launches, device µs]

ROWS = {"ar": dict(num_draft_tokens=0), "eagle-chain": dict(num_draft_tokens=6, max_depth=6, top_k=1),
        "eagle-tree": dict(num_draft_tokens=15, max_depth=6, top_k=4)}


def timed_graph(fn, replays=50, recorded=None):
    """:func:`e2e.graph_time` (median device ms and kernels per replay, 4 decimals); on the CPU
    (``--device cpu``, a logic check) ``fn`` runs eagerly and the count is of operators."""
    if not CUDA:
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return 0.0, sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    ms, kernels = graph_time(fn, replays, recorded, KERNEL_NAMES.setdefault(len(KERNEL_NAMES), {}) if NAMES else None)
    return round(ms, 4), kernels


def sync():
    if CUDA:
        torch.cuda.synchronize()


def parts(dec, prompts):
    """Each part of a recorded step timed alone (see the module docstring)."""
    ad, dr, cfg = dec.adapter, dec.drafter, dec.config
    ad.prefill(prompts)
    dr.reset(prompts)
    runner = G.GraphRunner(ad, dr, cfg, capture=CUDA)
    runner.step([list(p) for p in prompts])  # eager: leaves the pending commit the graphs read
    state, dstate = ad.graph_state(), dr.graph_state()  # with the pending commit
    pending = ad.pending
    depth = min(cfg.max_depth, cfg.num_draft_tokens)
    out, box = {}, {}

    def propose():
        box["tree"] = dr.propose_on_device(ad.roots, cfg)

    def verify():
        ad.pending = pending  # verify takes the pending commit over
        box["out"] = ad._verify(box["tree"])

    def accept_commit():
        acc = accept_greedy(box["tree"], box["out"].logits, max_depth=depth,
                            kernels=bool(getattr(ad, "triton_kernels", False)))  # as the recorded step does
        ad._commit(box["tree"], box["out"], acc)
        dr.on_commit(acc, box["out"])

    ad.static_shapes = True
    try:
        if cfg.num_draft_tokens:
            out["propose"] = timed_graph(propose)
        else:
            box["tree"] = DraftTree.empty(ad.batch_size, ad.device)
        out["verify"] = timed_graph(verify)
        out["accept_commit"] = timed_graph(accept_commit)
    finally:
        ad.static_shapes = False
    ad.set_graph_state(state)  # back to the state with the pending commit
    dr.set_graph_state(dstate)
    g = runner._new_graph(ad.batch_size, state, dstate)
    ad.set_graph_state(g.state)
    dr.set_graph_state(g.drafter_state)
    out["step"] = timed_graph(lambda: runner._record(g), recorded=g.graph)
    ad.flush()
    names = list(KERNEL_NAMES.values())
    KERNEL_NAMES.clear()
    return {k: {"ms": v[0], "kernels": v[1], **({"by_name": names[i]} if NAMES and CUDA else {})}
            for i, (k, v) in enumerate(out.items())}


def prefill_parts(dec, prompts, repeats=5):
    """The prefill's halves (see the module docstring): ms each (medians), then one profiled."""
    ad, dr = dec.adapter, dec.drafter
    times = {"adapter_prefill": [], "drafter_reset": []}
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        ad.prefill(prompts)
        sync()
        t1 = time.perf_counter()
        dr.reset(prompts)
        sync()
        times["adapter_prefill"].append((t1 - t) * 1e3)
        times["drafter_reset"].append((time.perf_counter() - t1) * 1e3)
    out = {k: round(statistics.median(v), 3) for k, v in times.items()}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    for name, fn in (("adapter_prefill", lambda: ad.prefill(prompts)), ("drafter_reset", lambda: dr.reset(prompts))):
        with profile(activities=acts) as prof:
            fn()
            sync()
        ev = prof.key_averages()
        dev = [e for e in ev if e.device_type.name == "CUDA"]
        host = sorted((e for e in ev if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
        out[name + "_profile"] = dict(
            kernels=sum(e.count for e in dev), device_us=round(sum(e.self_device_time_total for e in dev), 1),
            host_ops=[[e.key[:60], e.count, round(e.self_cpu_time_total, 1)] for e in host[:12]])
    sync()
    t = time.perf_counter()
    for _ in range(20):
        torch.cuda.mem_get_info() if CUDA else None
    out["mem_get_info_us"] = round((time.perf_counter() - t) / 20 * 1e6, 1)
    return out


def whole_calls(dec, prompts, repeats=5):
    """Medians over ``repeats`` timed calls after a warm-up call: the call's parts in ms."""
    rec = {}
    orig_step = G.GraphRunner.step
    orig_flush = type(dec.adapter).flush

    def step(self, contexts):
        sync()
        t = time.perf_counter()
        r = orig_step(self, contexts)
        rec.setdefault("steps", []).append(time.perf_counter() - t)
        return r

    def flush(self):
        sync()
        t = time.perf_counter()
        orig_flush(self)
        sync()
        rec.setdefault("flush", []).append(time.perf_counter() - t)

    G.GraphRunner.step, type(dec.adapter).flush = step, flush
    try:
        dec.generate(prompts)
        rows = []
        for _ in range(repeats):
            rec.clear()
            sync()
            t = time.perf_counter()
            r = dec.generate(prompts)
            sync()
            wall = time.perf_counter() - t
            st = rec["steps"]
            rows.append(dict(wall_ms=wall * 1e3, prefill_ms=r.stats.prefill_s * 1e3, first_step_ms=st[0] * 1e3,
                             step_ms_median=statistics.median(st[1:] or st) * 1e3, steps=r.stats.steps,
                             flush_ms=sum(rec.get("flush", [0])) * 1e3, accepted=r.stats.mean_accepted_tokens,
                             tokens=r.stats.generated_tokens))
    finally:
        G.GraphRunner.step, type(dec.adapter).flush = orig_step, orig_flush
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--prompt-len", type=int, default=69)
    p.add_argument("--device", default="cuda", help="cpu: check the script's logic (no timings)")
    p.add_argument("--preset", default="small", choices=("tiny", "small", "gdn-1.3b"),
                   help="the model shape: a GDN preset of train_target.py, or GDN-1.3B's (24 layers, as e2e.py)")
    p.add_argument("--prefill", action="store_true", help="also time and profile the prefill's halves")
    p.add_argument("--kernel-names", action="store_true",
                   help="each part's kernels by name: launches and device µs in one profiled replay")
    a = add_allow_dirty(p).parse_args()
    print_meta(a.device, a.allow_dirty)
    global CUDA, NAMES
    CUDA, NAMES = a.device == "cuda", a.kernel_names
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    shape = dict(num_hidden_layers=24, **GDN13B_SHAPE) if a.preset == "gdn-1.3b" else PRESETS[a.preset]["model"]
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **shape))
    model = model.to(a.device, dtype).eval()
    head = EagleHead(model.config.hidden_size)
    for B in (int(x) for x in a.batches.split(",")):
        g = torch.Generator().manual_seed(B)
        prompts = [torch.randint(0, 32000, (a.prompt_len,), generator=g).tolist() for _ in range(B)]
        if CUDA:
            ms, kernels = fla_graph_step(model, prompts)
            print(json.dumps(dict(batch=B, row="fla-graph", step=[round(ms, 4), kernels])), flush=True)
        for name in a.rows.split(","):
            tree = ROWS[name]
            drafter = EagleDrafter(head) if tree["num_draft_tokens"] else "ngram"
            dec = SpecDecoder(model, "gdn", drafter=drafter, config=dict(
                dtype=a.dtype, device=a.device, max_new_tokens=128, stop_at_eos=False,
                engine=dict(cuda_graphs="on" if CUDA else "unrecorded", budget_policy="fixed"), **tree))
            print(json.dumps(dict(batch=B, row=name, call=whole_calls(dec, prompts))), flush=True)
            if a.prefill:
                print(json.dumps(dict(batch=B, row=name, prefill=prefill_parts(dec, prompts))), flush=True)
            print(json.dumps(dict(batch=B, row=name, parts=parts(dec, prompts))), flush=True)
            del dec
            if CUDA:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
