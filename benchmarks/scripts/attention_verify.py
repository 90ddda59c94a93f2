"""One attention layer's verify of a draft tree over a fixed-capacity KV cache, and its commit, at
published hybrid shapes: the measurement issue 17 asks for to pick the attention kernel and the
commit timing (docs/architecture.md, "AttentionMixer").

    python benchmarks/scripts/attention_verify.py [--device cuda] [--shapes all] [--batches 1,8,32]
        [--nodes 16] [--capacity 1024] [--filled 512] [--variants sdpa_mask,commit_kv,flex]
        [--check-dtype float32] > attention.jsonl

Per shape, batch and variant, one JSON line: device ms per call (median replay of the call
recorded in a CUDA graph, as a recorded step runs it; on a CPU, the median of eager calls, a check
of the script only) and the largest absolute difference of its output from ``tree_attention``'s
(``--check-dtype`` inputs for the check, bfloat16 for the timing). Each variant runs at every shape
and batch before the next (``flex``, which compiles, last). Variants:

- ``sdpa_mask``: :func:`specla.mixers.attention.reference.tree_attention`, what the mixer runs: the cache and
  the tree's keys concatenated (a copy of the whole cache per call), one SDPA call with a boolean
  ``[B, T, S + T]`` mask and grouped-query heads;
- ``flex``: torch's FlexAttention (compiled) over the same concatenated keys, its block mask
  built from the same rule inside the call (``mask_mod`` reads the cache lengths and the
  ancestor mask), so it records in a graph like the rest of a step;
- ``commit_kv``: :func:`specla.mixers.attention.reference.commit_kv` of a ``D + 1``-token accepted path on its
  own: what committing at once costs per layer; the delayed commit runs the same kernels at the
  start of the next verify, so the two differ in where the launches go, not in their number.

Trees: ``--nodes`` nodes plus the root, grown best-first with at most 4 children per node (the
EAGLE tree's shape). Cache: ``--capacity`` slots (a recorded step attends over all of them),
``--filled`` of them committed. Not a model run: one layer's kernels.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import replay_ms  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402
from kernels import pruned_tree  # noqa: E402

from specla.cuda.capture import record_graph  # noqa: E402
from specla.mixers.attention.reference import commit_kv, tree_attention, tree_attention_mask  # noqa: E402
from specla.tree import inclusive_ancestor_mask  # noqa: E402

# name: (query heads, key/value heads, head dim, where the shape comes from)
SHAPES = {
    "qwen3_5-0.8b": (8, 2, 256, "Qwen3.5-0.8B's gated attention"),
    "qwen3-next-80b": (16, 2, 256, "Qwen3-Next-80B-A3B's gated attention"),
    "nemotron-h-8b": (32, 8, 128, "Nemotron-H-8B's attention"),
    "granite-4.0-h-tiny": (12, 4, 128, "Granite-4.0-H-Tiny's attention"),
    "tiny": (4, 2, 16, "a CPU check of the script"),
}


def inputs(B: int, T: int, H: int, HKV: int, D: int, S: int, filled: int, parents: list[int], dtype, dev):
    """Random queries, keys, values, a cache of ``S`` slots with ``filled`` committed, and the
    tree's ancestor mask and depths (every row the same tree)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    par = torch.tensor([[-1] + [p + 1 for p in parents]] * B, device=dev)  # root-explicit
    anc = inclusive_ancestor_mask(par)
    return dict(q=r(B, T, H, D), k=r(B, T, HKV, D), v=r(B, T, HKV, D), k_cache=r(B, S, HKV, D),
                v_cache=r(B, S, HKV, D), cache_len=torch.full((B,), filled, device=dev), ancestors=anc,
                depth=anc.sum(-1) - 1)


def flex_tree_attention():
    """``tree_attention`` through FlexAttention: the same mask rule, compiled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, k_cache, v_cache, cache_len, ancestors, depth):
        B, T, H, _ = q.shape
        S = k_cache.shape[1]
        allowed = tree_attention_mask(ancestors, cache_len, S, depth)  # [B, T, S + T]
        block = create_block_mask(lambda b, h, i, j: allowed[b, i, j], B, None, T, S + T, device=q.device)
        keys = torch.cat([k_cache, k], 1).transpose(1, 2)
        values = torch.cat([v_cache, v], 1).transpose(1, 2)
        out = flex(q.transpose(1, 2), keys, values, block_mask=block, enable_gqa=H != k.shape[2])
        return out.transpose(1, 2)

    return run


def timed(fn, dev: str, reps: int) -> float:
    """Median ms of ``fn``: CUDA-graph replays on a GPU, eager calls on a CPU."""
    if dev == "cuda":
        return replay_ms(record_graph(fn, dev), reps)
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="all", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--filled", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", default="sdpa_mask,commit_kv,flex")
    ap.add_argument("--check-dtype", default="float32", help="the inputs of the output check")
    a = add_allow_dirty(ap).parse_args()
    print_meta(a.device, a.allow_dirty)
    a.check_dtype = getattr(torch, a.check_dtype)
    names = [n for n in SHAPES if n != "tiny"] if a.shapes == "all" else a.shapes.split(",")
    parents = pruned_tree(a.nodes, 4, 6, random.Random(0))
    T, flex = a.nodes + 1, flex_tree_attention()
    # FlexAttention compiles per shape, which can take minutes (at head dim 256 a float32 compile
    # ran past the command limit, BENCHMARKS.md "What was not measured"): every SDPA and commit
    # row is measured first
    variants = [v for v in ("sdpa_mask", "commit_kv", "flex") if v in a.variants.split(",")]
    for variant in variants:
        for name in names:
            H, HKV, D, source = SHAPES[name]
            for B in (int(b) for b in a.batches.split(",")):
                data = inputs(B, T, H, HKV, D, a.capacity, a.filled, parents, torch.bfloat16, a.device)
                if variant == "commit_kv":
                    P = int(data["depth"].max()) + 1
                    path = torch.arange(P, device=a.device).expand(B, -1).contiguous()  # P slots' worth (timing only)
                    path_len = torch.full((B,), P, device=a.device)
                    fn = lambda k_cache, v_cache, cache_len, k, v, **_: commit_kv(  # noqa: E731
                        k_cache, v_cache, cache_len, k, v, path, path_len, capacity=a.capacity - T)
                else:
                    fn = tree_attention if variant == "sdpa_mask" else flex
                try:  # a variant that fails (or that a graph cannot record) is reported, not fatal
                    err = None
                    if variant != "commit_kv":  # checked against tree_attention in float32
                        check = inputs(B, T, H, HKV, D, a.capacity, a.filled, parents, a.check_dtype, a.device)
                        err = float((fn(**check).float() - tree_attention(**check).float()).abs().max())
                    ms = timed(lambda: fn(**data), a.device, a.reps)
                except Exception as e:
                    ms, err = None, f"{type(e).__name__}: {e}"[:300]
                print(json.dumps(dict(shape=name, source=source, B=B, nodes=T, capacity=a.capacity, filled=a.filled,
                                      variant=variant, ms=ms, max_abs_err=err)), flush=True)

if __name__ == "__main__":
    main()
