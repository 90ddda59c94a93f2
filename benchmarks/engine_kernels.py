"""specla's GDN verify + commit on a serving engine's data against the engines' own published
Triton kernels, side by side in one process (issue 44; ../shared/docs/ENGINES.md).

    python benchmarks/engine_kernels.py --extract .engines          # with network: the kernel files
    python benchmarks/engine_kernels.py --kernels .engines --out engine.json [--tp 4] [--batches 1,64]
    TRITON_INTERPRET=1 python benchmarks/engine_kernels.py --device cpu --preset tiny --out tiny.json

The engines' kernel files (SGLang 0.5.23, vLLM 0.34.0: :mod:`specla.testing.engine_kernels`) are
read from ``--kernels DIR`` (a folder ``--extract DIR`` wrote) or from the per-user cache, which
downloads them. One cell is one layer of one rank (heads split by tensor parallelism ``--tp``) at
one batch and one draft shape; every call is one layer:
- ``treeD``: trees of ``D`` nodes (root included), each row its own, grown best-first with up to
  4 children a node (``kernels.pruned_tree``, seeded); each row accepts the root path of a
  random node. specla (``gdn_pool_verify`` + ``gdn_pool_commit``) against SGLang's tree verify
  (``fused_sigmoid_gating_delta_rule_update`` with ``retrieve_parent_token`` and one fp32 state
  per node in ``intermediate_states_buffer``) + the accepted node's state scattered into the pool.
- ``chainT``: chains of ``T`` tokens, each row accepting a random prefix. specla, SGLang's
  per-node snapshots as above, SGLang's ReplaySSM (verify writing the raw k, v (activation
  dtype), gate and beta (fp32) into per-slot rings, then its fold replaying the accepted prefix
  into the pool) and vLLM's chain kernel (one state slot per position, ``ssm_state_indices
  [N, T]``; it commits by reading the last accepted position's slot at the next step, no copy).
The state pool has ``2 N + 1`` fp32 slots ``[slots, HV, V, K]`` (vLLM's ``2 N T + 1``, slot 0 its
null block), the rows' slots picked at random; q, k, v are strided views of one projection, a
and b raw gate inputs, all in ``--dtype``; ``A_log``, ``dt_bias`` fp32; q, k l2-normed in the kernels.

Before timing, every contender runs once on the cell's inputs from its own copy of the pool, and
its outputs and committed states are compared with SGLang's per-node snapshots (the engine's
own): max abs errors recorded; a cell agrees when every output is within ``2^-7 |ref| + 1e-4
max|ref|`` (one bf16 rounding) and every committed state within ``1e-4 max|ref|``. A cell that
does not agree is timed and marked. Times: on CUDA, each contender's calls over rotating input
sets (``kernels.copies_for``) are captured in one CUDA graph; the graphs are replayed in turn
(interleaved), ``--reps`` times after 3 untimed rounds: the median device µs per call. On the CPU
(Triton's interpreter) the median wall µs of direct calls, which says nothing about a GPU.

Memory per running request and layer, from the buffers each contender allocated: its pool
slot(s) plus its speculation buffers (SGLang: ``D`` states; specla: its factor records; ReplaySSM:
its rings; vLLM: ``T`` slots in all); times the model's GDN layers, and how many running requests
fit in ``--budget-gib`` on one rank. Writes ``--out`` (JSON: ``meta`` provenance, ``cells``,
``memory``) and the same path with ``.md`` (tables), printed last.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

from kernels import copies_for, pruned_tree  # this folder is on sys.path when the script runs
from provenance import add_allow_dirty, provenance
from specla.mixers.gdn.serving import empty_record_buffers, gdn_pool_commit, gdn_pool_verify
from specla.testing import engine_kernels

# GDN shapes of the whole model: key heads H, value heads HV, head dims K, V, GDN layers
MODELS = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, every fourth full attention;
    # linear_num_{key,value}_heads 16, 32, linear_{key,value}_head_dim 128
    "qwen3-next-80b-a3b": dict(H=16, HV=32, K=128, V=128, layers=36),
    # 40 layers, linear attention 3 of every 4 (THUDM/slime scripts/models/qwen3.5-35B-A3B.sh)
    "qwen3.5-35b-a3b": dict(H=16, HV=32, K=128, V=128, layers=30),
    "tiny": dict(H=2, HV=4, K=16, V=16, layers=2),
}
PRESETS = {
    "full": dict(models="qwen3-next-80b-a3b,qwen3.5-35b-a3b", tp="2,4,8", batches="1,8,32,64,128,256",
                 trees="8,16,32,64", chains="4,8", dtype="bfloat16"),
    "tiny": dict(models="tiny", tp="1", batches="1,3", trees="6", chains="3", dtype="float32"),
}
REFERENCE = "sglang"


class Contender(NamedTuple):
    run: Callable[[], torch.Tensor]  # one layer's verify + commit; returns o [1, Ttot, HV, V]
    committed: Callable[[], torch.Tensor]  # [N, HV, V, K] the rows' committed states
    slot_bytes: int  # pool bytes a running request holds (one layer)
    spec_bytes: int  # speculation buffers a running request holds (one layer)


def cell_inputs(H, HV, K, V, N, D, tree: bool, dtype, dev, seed: int) -> SimpleNamespace:
    """One layer's verify inputs for ``N`` rows of ``D`` tokens, the pool, and the acceptance."""
    rng, gen = random.Random(seed), torch.Generator(dev).manual_seed(seed)
    rnd = lambda *s, dt=torch.float32: torch.randn(*s, generator=gen, device=dev).to(dt)  # noqa: E731
    T = N * D
    mixed = rnd(T, 2 * H * K + HV * V, dt=dtype)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    layer = dict(q=q.view(1, T, H, K), k=k.view(1, T, H, K), v=v.view(1, T, HV, V), a=rnd(T, HV, dt=dtype),
                 b=rnd(T, HV, dt=dtype), A_log=torch.rand(HV, generator=gen, device=dev) * 2 - 1,
                 dt_bias=rnd(HV) * 0.5)
    trees = [pruned_tree(D, 4, min(D - 1, 8), rng) if tree else list(range(-1, D - 1)) for _ in range(N)]
    paths = []
    for par in trees:
        path = [rng.randrange(D)]
        while path[-1] > 0:
            path.append(par[path[-1]])
        paths.append(path[::-1])
    accept_index = torch.full((N, D), -1, dtype=torch.int64)
    for n, p in enumerate(paths):
        accept_index[n, : len(p)] = torch.tensor(p) + n * D
    slots = 2 * N + 1
    i32 = dict(dtype=torch.int32, device=dev)
    return SimpleNamespace(
        H=H, HV=HV, K=K, V=V, N=N, D=D, layer=layer, pool=rnd(slots, HV, V, K) * 0.3,
        slot=torch.randperm(slots, generator=gen, device=dev)[:N].to(torch.int32),
        rows=torch.randperm(N, generator=gen, device=dev).to(torch.int32),
        qsl=torch.arange(0, T + 1, D, **i32), parents=torch.tensor(trees, device=dev) if tree else None,
        accept_index=accept_index.to(dev), accept_lens=torch.tensor([len(p) for p in paths], **i32),
        last=torch.tensor([p[-1] for p in paths], device=dev),
        prev_accepted=torch.tensor([rng.randint(1, D) for _ in range(N)], **i32))


SG_CALL = dict(softplus_beta=1.0, softplus_threshold=20.0, use_qk_l2norm_in_kernel=True)


def specla(x, _) -> Contender:
    pool = x.pool.clone()
    rec = empty_record_buffers(x.N, x.D, x.H, x.HV, x.K, x.V, pool.device)

    def run():
        o = gdn_pool_verify(**SG_CALL, initial_state_source=pool, initial_state_indices=x.slot, cu_seqlens=x.qsl,
                            records=rec, intermediate_state_indices=x.rows, cache_steps=x.D,
                            retrieve_parent_token=x.parents, **x.layer)
        gdn_pool_commit(pool, x.slot, rec, x.rows, x.accept_index, x.accept_lens, x.D)
        return o
    return Contender(run, lambda: pool[x.slot.long()], pool[0].nbytes, sum(r.nbytes for r in rec) // x.N)


def sglang(x, eng) -> Contender:
    pool = x.pool.clone()
    scratch = torch.empty(x.N, x.D, x.HV, x.V, x.K, device=pool.device)  # MambaPool's intermediate buffer
    slot, rows = x.slot.long(), x.rows.long()

    def run():
        o = eng.sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
            **SG_CALL, initial_state_source=pool, initial_state_indices=x.slot, cu_seqlens=x.qsl, is_kda=False,
            disable_state_update=True, intermediate_states_buffer=scratch, intermediate_state_indices=x.rows,
            cache_steps=x.D, retrieve_parent_token=x.parents, **x.layer)
        pool[slot] = scratch[rows, x.last]  # the accepted node's snapshot into the request's slot
        return o
    return Contender(run, lambda: pool[slot], pool[0].nbytes, scratch.nbytes // x.N)


def sglang_replayssm(x, eng) -> Contender:
    pool = x.pool.clone()
    S, dt, dev = pool.shape[0], x.layer["v"].dtype, pool.device
    ring = dict(replayssm_rawv=torch.empty(S, x.HV, x.D, x.V, dtype=dt, device=dev),
                replayssm_rawk=torch.empty(S, x.H, x.D, x.K, dtype=dt, device=dev),
                replayssm_g=torch.empty(S, x.HV, x.D, device=dev), replayssm_beta=torch.empty(S, x.HV, x.D, device=dev))

    def run():
        o = eng.sglang.recurrent.fused_sigmoid_gating_delta_rule_update(
            **SG_CALL, initial_state_source=pool, initial_state_indices=x.slot, cu_seqlens=x.qsl, is_kda=False,
            disable_state_update=True, cache_ring=True, **ring, **x.layer)
        eng.sglang.fold.commit_gdn_replayssm_fold_all_layers(
            pool[None], *(ring[f"replayssm_{n}"][None] for n in ("rawv", "rawk", "g", "beta")), x.slot,
            x.accept_lens, max_cache_len=x.D, num_k_heads=x.H)
        return o
    return Contender(run, lambda: pool[x.slot.long()], pool[0].nbytes, sum(r.nbytes for r in ring.values()) // S)


def vllm(x, eng) -> Contender:
    N, D, dev = x.N, x.D, x.pool.device
    gen = torch.Generator(dev).manual_seed(N * D)
    vslots = (1 + torch.randperm(2 * N * D, generator=gen, device=dev)[: N * D]).view(N, D).to(torch.int32)
    vpool = torch.empty(1 + 2 * N * D, x.HV, x.V, x.K, device=dev)
    rows = torch.arange(N, device=dev)
    vpool[vslots[rows, x.prev_accepted.long() - 1].long()] = x.pool[x.slot.long()]  # the last step's accepted

    def run():
        return eng.vllm.fused_sigmoid_gating_delta_rule_update(
            initial_state=vpool, inplace_final_state=True, cu_seqlens=x.qsl, ssm_state_indices=vslots,
            num_accepted_tokens=x.prev_accepted, use_qk_l2norm_in_kernel=True, **x.layer)[0]
    slot_bytes = vpool[0].nbytes
    return Contender(run, lambda: vpool[vslots[rows, x.accept_lens.long() - 1].long()], slot_bytes,
                     (vslots.shape[1] - 1) * slot_bytes)


CONTENDERS = {"tree": {"specla": specla, "sglang": sglang},
              "chain": {"specla": specla, "sglang": sglang, "sglang_replayssm": sglang_replayssm, "vllm": vllm}}


def check(outs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, bool]:
    """Max abs errors of every contender's output and committed states against :data:`REFERENCE`'s,
    and whether all are within the tolerance (module docstring)."""
    o_ref, s_ref = (t.double() for t in outs[REFERENCE])
    o_scale, s_scale = o_ref.abs().max().item(), s_ref.abs().max().item()
    errors, ok = {}, True
    for name, (o, s) in outs.items():
        if name == REFERENCE:
            continue
        do, ds = (o.double() - o_ref).abs(), (s.double() - s_ref).abs()
        good = bool(torch.isfinite(do).all() and torch.isfinite(ds).all()) and \
            bool((do <= 2**-7 * o_ref.abs() + 1e-4 * o_scale).all()) and ds.max().item() <= 1e-4 * s_scale
        errors[name] = dict(out=do.max().item(), state=ds.max().item(), agree=good)
        ok &= good
    return dict(errors, ref_out_max=o_scale, ref_state_max=s_scale), ok


def time_us(sets: list[dict[str, Contender]], reps: int, dev: str) -> dict[str, float]:
    """Median µs of one call of each contender (module docstring), interleaved."""
    names = list(sets[0])
    times = {n: [] for n in names}
    if dev == "cpu":
        for _ in range(reps):
            for n in names:
                t0 = time.perf_counter()
                for s in sets:
                    s[n].run()
                times[n].append((time.perf_counter() - t0) * 1e6 / len(sets))
        return {n: statistics.median(t) for n, t in times.items()}
    from specla.cuda.capture import record_graph

    graphs = {n: record_graph(lambda n=n: [s[n].run() for s in sets], dev) for n in names}
    for r in range(3 + reps):
        for n, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            if r >= 3:
                times[n].append(a.elapsed_time(b) * 1e3 / len(sets))
    return {n: statistics.median(t) for n, t in times.items()}


def run_cell(eng, shape, N, kind, D, args, seed) -> dict:
    H, HV, K, V = shape
    dev, dtype = args.device, getattr(torch, args.dtype)
    build = CONTENDERS[kind]
    x0 = cell_inputs(H, HV, K, V, N, D, kind == "tree", dtype, dev, seed)
    first = {n: f(x0, eng) for n, f in build.items()}
    outs = {n: (c.run(), c.committed()) for n, c in first.items()}
    errors, agree = check(outs)
    del outs
    per_set = N * (HV * V * K * 4 + D * (2 * H * K + HV * V) * x0.layer["v"].element_size())
    copies = 1 if dev == "cpu" else copies_for(per_set)
    sets = [first] + [{n: f(cell_inputs(H, HV, K, V, N, D, kind == "tree", dtype, dev, seed + i), eng)
                       for n, f in build.items()} for i in range(1, copies)]
    us = time_us(sets, args.reps, dev)
    mem = {n: dict(slot_bytes=c.slot_bytes, spec_bytes=c.spec_bytes) for n, c in first.items()}
    return dict(H=H, HV=HV, K=K, V=V, batch=N, workload=f"{kind}{D}", input_sets=copies, us=us, memory=mem,
                errors=errors, agree=agree)


def memory_rows(cells: list[dict], shapes: dict, budget_gib: float) -> list[dict]:
    """Per model, rank and workload: bytes a running request holds, one layer and all GDN layers,
    and the running requests that fit in the budget (one rank)."""
    rows, seen = [], set()
    for c in cells:
        for model, tp in shapes[(c["H"], c["HV"], c["K"], c["V"])]:
            if (model, tp, c["workload"]) in seen:
                continue
            seen.add((model, tp, c["workload"]))
            layers = MODELS[model]["layers"]
            for name, m in c["memory"].items():
                per_layer = m["slot_bytes"] + m["spec_bytes"]
                rows.append(dict(model=model, tp=tp, workload=c["workload"], contender=name, layer_bytes=per_layer,
                                 spec_layer_bytes=m["spec_bytes"], model_bytes=per_layer * layers,
                                 requests_in_budget=int(budget_gib * 2**30 // (per_layer * layers))))
    return rows


def markdown(report: dict) -> str:
    names = list(CONTENDERS["chain"])
    lines = [f"GDN verify + commit, one layer of one rank, µs per call ({report['meta']['device']}); "
             f"errors against {REFERENCE}", "",
             "| models (TP) | H/HV | batch | workload | " + " | ".join(names) + " | agree | max err out / state |",
             "|---" * (6 + len(names)) + "|"]
    for c in report["cells"]:
        errs = "; ".join(f"{n} {e['out']:.1e} / {e['state']:.1e}" for n, e in c["errors"].items()
                         if isinstance(e, dict))
        lines.append(f"| {c['models']} | {c['H']}/{c['HV']} | {c['batch']} | {c['workload']} | "
                     + " | ".join(f"{c['us'][n]:.1f}" if n in c["us"] else "-" for n in names)
                     + f" | {'yes' if c['agree'] else '**NO**'} | {errs} |")
    lines += ["", f"Memory a running request holds (state slot + speculation buffers), requests in "
              f"{report['args']['budget_gib']} GiB a rank", "",
              "| model | TP | workload | contender | KiB a layer | of which speculation | MiB all GDN layers | "
              "requests |", "|---" * 8 + "|"]
    lines += [f"| {m['model']} | {m['tp']} | {m['workload']} | {m['contender']} | {m['layer_bytes'] / 2**10:.1f} | "
              f"{m['spec_layer_bytes'] / 2**10:.1f} | {m['model_bytes'] / 2**20:.1f} | {m['requests_in_budget']} |"
              for m in report["memory"]]
    return "\n".join(lines) + "\n"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = add_allow_dirty(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--out", help="JSON report path (the tables go to the same path with .md)")
    ap.add_argument("--extract", metavar="DIR", help="copy both engines' kernel files into DIR (same layout) and exit")
    ap.add_argument("--kernels", metavar="DIR", help="read the engines' kernel files from DIR (--extract's layout) "
                                                     "instead of the per-user cache")
    ap.add_argument("--preset", choices=PRESETS, default="full")
    for name in ("models", "tp", "batches", "trees", "chains", "dtype"):
        ap.add_argument(f"--{name}", help=f"comma-separated; default: the preset's ({PRESETS['full'][name]} for full)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50, help="timed rounds (median)")
    ap.add_argument("--budget-gib", type=float, default=10.0, help="memory a rank gives running requests' GDN state")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prog = Path(sys.argv[0]).name
    try:
        if args.extract:
            print("\n".join(str(p) for p in engine_kernels.extract(args.extract, args.kernels)))
            return 0
        eng = SimpleNamespace(sglang=engine_kernels.load_sglang(args.kernels),
                              vllm=engine_kernels.load_vllm(args.kernels))
    except (engine_kernels.RegistryUnreachable, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if not args.out:
        ap.error("--out is required (except with --extract)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU; torch sees none (--device cpu under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    for name, value in PRESETS[args.preset].items():
        setattr(args, name, getattr(args, name) or value)
    meta = provenance(args.device, args.allow_dirty)
    meta["engines"] = {e["name"]: e["version"] for e in engine_kernels.ENGINES}
    # what SGLang's kernel picked its launch from (tiles for the tree verify on SM90; PDL)
    meta["sglang_probes"] = dict(sm90=eng.sglang.recurrent._is_sm90, pdl=eng.sglang.recurrent.is_arch_support_pdl())
    shapes: dict[tuple, list] = {}  # per-rank shape -> [(model, tp)]: models of one shape are timed once
    for model in args.models.split(","):
        m = MODELS[model]
        for tp in ints(args.tp):
            if m["H"] % tp or m["HV"] % tp:
                ap.error(f"{model}'s {m['H']} key and {m['HV']} value heads do not split over TP {tp}")
            shapes.setdefault((m["H"] // tp, m["HV"] // tp, m["K"], m["V"]), []).append((model, tp))
    cells = []
    work = [("tree", D) for D in ints(args.trees)] + [("chain", D) for D in ints(args.chains)]
    for shape, users in shapes.items():
        for N in ints(args.batches):
            for kind, D in work:
                c = run_cell(eng, shape, N, kind, D, args, seed=args.seed + 1000 * N + D)
                c["models"] = ", ".join(f"{m} ({tp})" for m, tp in users)
                cells.append(c)
                print(json.dumps(c), flush=True)
    report = dict(meta=meta, args=vars(args), cells=cells, memory=memory_rows(cells, shapes, args.budget_gib))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
