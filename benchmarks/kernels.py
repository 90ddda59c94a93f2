"""Kernel benchmarks at 1.3B-like layer shapes: GDN (issue 4), GLA and Mamba2 (issue 6);
docs/DESIGN.md section 8.

    python benchmarks/kernels.py --out kernels.json                  # GDN; one GPU, FLA for the baselines
    python benchmarks/kernels.py --plugin gla --out gla.json         # GLA: verify and commit rows
    python benchmarks/kernels.py --plugin mamba2 --out mamba2.json   # Mamba2: verify and commit rows

One layer, activations in bfloat16, gates and the recurrent state in float32:
- gdn: GDN-1.3B, H = HV = 8 heads, K = V = 256; q/k/v bf16, g and beta float32.
- gla: FLA GLA-1.3B (hidden 2048), H = 4 heads, K = 256, V = 512 per head; q/k/v bf16, gk
  (per-channel log decay, ``logsigmoid / 16`` as FLA's layer) float32.
- mamba2: FLA Mamba2-1.3B (d_model 2048, expand 2), H = 64 heads of P = 64, state N = 128, one
  group; x, B, C bf16, dt, the log decay ``a = dt A``, D float32.

Trees are root-explicit (node 0 is the last committed token) and are given by their total
node count ``T`` (root included); ``pruned`` trees are grown best-first with random confidences,
like the drafter's; ``topkK depthD`` trees reach depth D with at most K children per node.

Times are device times: each measured call is captured in a CUDA graph (with several input
sets rotated so the working set exceeds the L2) and the graph replayed; the median replay over the
number of calls. ``*_eager_ms`` adds the launcher's host overhead (``do_bench`` on one input set).

Rows:
- verify: serial (chains only), parallel (``T <= 64``), hybrid (launch plan built once per step,
  its host time reported apart), against root-to-leaf replay with FLA's ``fused_recurrent`` (one
  call per root-to-leaf path, inputs gathered beforehand: the baseline's best case). Each kernel's
  outputs are checked against the replay's before timing.
- commit of ``a`` accepted tokens: factor (closed form, :func:`flush_commit`) vs token replay
  (FLA ``fused_recurrent`` over the accepted tokens, final state out) vs snapshot (copy of the
  per-node state saved during verify); with the transient memory each strategy keeps per
  sequence and layer.
- fused verify+commit vs a separate commit kernel followed by verify.
- floor: compulsory bytes (state read, inputs read, outputs and factor records written; the commit's
  state write when fused) over the measured copy bandwidth.

GLA and Mamba2 (``--plugin gla|mamba2``; no hybrid kernel, no fused or sweep study), same trees:
- verify: serial (chains only) and parallel (every tree, ``T <= 64``) against root-to-leaf replay
  with FLA's fused recurrent kernel (one call per path, inputs gathered beforehand). GLA replays
  with ``fused_recurrent_gla``; Mamba2's SSD is a scalar-decay linear attention (q = C, k = B,
  v = dt x, per-head log decay g = dt A, scale 1; B and C repeated to the heads), replayed with
  ``fused_recurrent_simple_gla``, its ``D x`` skip added outside the timed calls for the check
  (the kernels fuse it). Each kernel's outputs are checked against the replay's before timing.
- commit of ``a`` accepted tokens (1..8) out of a 16-node chain: factor (``flush_commit`` from
  the serial kernel's records) vs token replay (the same FLA kernel, final state out) vs
  snapshot (a state copy); the factor state is checked against the replay's.
- floor: as for GDN (verify: state read, inputs, outputs and records; commit: records read, state
  read and written).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from e2e import replay_ms  # this folder is on sys.path when the script runs
from provenance import add_allow_dirty, provenance
from specla.cuda.capture import record_graph
from specla.records import LayerCommit
from specla.tree import inclusive_ancestor_mask
from specla.mixers.gdn.commit import flush_commit
from specla.mixers.gdn.records import GDNFactorRecord
from specla.mixers.gdn.verify import MAX_TREE_NODES, hybrid_plan, hybrid_verify, serial_verify, tree_verify

H = HV = 8
K = V = 256
DEV = "cuda"


def pruned_tree(nodes: int, top_k: int, max_depth: int, rng: random.Random) -> list[int]:
    """Parents of a root-explicit tree of ``nodes`` nodes grown best-first by path log-probability
    (random confidences), at most ``top_k`` children per node and ``max_depth`` levels below the root."""
    parents, depth = [-1], [0]
    heap: list[tuple[float, int, int]] = []

    def push_children(node: int, score: float) -> None:
        if depth[node] >= max_depth:
            return
        probs = sorted((rng.random() ** 3 for _ in range(top_k)), reverse=True)
        total = sum(probs) * (1 + rng.random())
        for p in probs:
            heapq.heappush(heap, (-(score + math.log(p / total)), rng.random(), node))

    push_children(0, 0.0)
    while len(parents) < nodes and heap:
        neg, _, par = heapq.heappop(heap)
        parents.append(par)
        depth.append(depth[par] + 1)
        push_children(len(parents) - 1, -neg)
    return parents


def deep_tree(nodes: int, top_k: int, depth: int, rng: random.Random) -> list[int]:
    """A tree that reaches ``depth`` levels below the root (a main chain), the other nodes
    attached at random where a node has fewer than ``top_k`` children and is above ``depth``."""
    parents, level, kids = [-1], [0], [0]
    while len(parents) < nodes:
        if len(parents) <= depth:
            par = len(parents) - 1
        else:
            par = rng.choice([i for i in range(len(parents)) if kids[i] < top_k and level[i] < depth])
        parents.append(par)
        level.append(level[par] + 1)
        kids[par] += 1
        kids.append(0)
    return parents


def trees() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {
        "chain T=8": list(range(-1, 7)),
        "chain T=16": list(range(-1, 15)),
        "topk2 depth12 T=16": deep_tree(16, 2, 12, rng),
        "topk4 depth4 T=32": deep_tree(32, 4, 4, rng),
        "pruned T=16": pruned_tree(16, 4, 10, rng),
        "pruned T=32": pruned_tree(32, 4, 10, rng),
        "pruned T=64": pruned_tree(64, 4, 12, rng),
    }


def leaves_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf node lists."""
    has_child = set(p for p in parents if p >= 0)
    out = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, n = [], leaf
        while n >= 0:
            path.append(n)
            n = parents[n]
        out.append(path[::-1])
    return out


def layer_inputs(B: int, T: int, gen: torch.Generator):
    q = F.normalize(torch.randn(B, T, H, K, device=DEV, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device=DEV, generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device=DEV, generator=gen).bfloat16()
    g = -torch.rand(B, T, HV, device=DEV, generator=gen) * 0.3
    beta = torch.rand(B, T, HV, device=DEV, generator=gen) * 0.9 + 0.05
    S0 = torch.randn(B, HV, K, V, device=DEV, generator=gen) * 0.1
    return q, k, v, g, beta, S0


def graph_ms(fns: list, reps: int = 25) -> float:
    """Median device time (ms) of one call: the calls ``fns`` (one per rotating input set, so the
    working set exceeds the 60 MB L2 as in a real step) are captured in one CUDA graph, which
    removes launch gaps and host overhead, and replayed ``reps`` times after a warm-up (the
    recording's own call, then 3 untimed replays)."""
    graph = record_graph(lambda: [fn() for fn in fns], "cuda")  # compiles, autotunes, allocates first
    return replay_ms(graph, reps, skip=3) / len(fns)


def copies_for(bytes_per_set: int) -> int:
    """Input sets to rotate through so that one graph replay touches > 2x the L2 (at most 48)."""
    return max(1, min(48, math.ceil(128 * 2**20 / bytes_per_set)))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of 1 GiB)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def verify_bytes(B: int, T: int, pending_tokens: int = 0) -> int:
    """Compulsory bytes of one layer's verify: the state once, inputs, outputs and factor records
    (plus, when a commit is fused, its records and the state written once)."""
    state = B * HV * K * V * 4
    inputs = B * T * (2 * H * K * 2 + HV * V * 2 + 2 * HV * 4)
    outputs = B * T * (HV * V * 2 + HV * V * 4 + HV * 4)
    commit = (B * pending_tokens * (H * K * 2 + HV * V * 4 + HV * 4) + state) if pending_tokens else 0
    return state + inputs + outputs + commit


def bench_verify(batches: list[int], bw: float, fla_replay) -> list[dict]:
    rows = []
    for name, par in trees().items():
        T = len(par)
        paths = leaves_paths(par)
        is_chain = par == list(range(-1, T - 1))
        for B in batches:
            gen = torch.Generator(device=DEV).manual_seed(B * 100 + T)
            scale = K**-0.5
            parents = torch.tensor(par, device=DEV).expand(B, T).contiguous()
            mask = inclusive_ancestor_mask(parents)
            plan = hybrid_plan(parents)
            nodes = torch.full((B,), T, dtype=torch.int64, device=DEV)
            sets = [layer_inputs(B, T, gen) for _ in range(copies_for(verify_bytes(B, T)))]
            # replay baseline: one fused_recurrent call per root-to-leaf path, inputs pre-gathered
            gathered = [[tuple(x[:, p].contiguous() for x in xs[:5]) for p in paths] for xs in sets]

            def replay(i):
                return [fla_replay(q, k, v, g=g, beta=b, scale=scale, initial_state=sets[i][5],
                                   output_final_state=False)[0] for q, k, v, g, b in gathered[i]]

            ref = torch.empty(B, T, HV, V, device=DEV, dtype=torch.float32)
            for p, o in zip(paths, replay(0)):
                ref[:, p] = o.float()
            n = len(sets)
            row = dict(tree=name, T=T, batch=B, paths=len(paths), waves=len(plan.waves), input_sets=n,
                       replay_ms=graph_ms([lambda i=i: replay(i) for i in range(n)]))
            row["hybrid_plan_host_ms"] = do_bench(lambda: hybrid_plan(parents), return_mode="median")
            kernels = {"hybrid": lambda i: hybrid_verify(*sets[i], parents, scale, plan=plan)}
            if T <= MAX_TREE_NODES:
                kernels["parallel"] = lambda i: tree_verify(*sets[i], mask, scale)
            if is_chain:
                kernels["serial"] = lambda i: serial_verify(*sets[i], nodes, scale)
            for kname, fn in kernels.items():
                o = fn(0)[0].float()
                row[f"{kname}_max_rel_err"] = float((o - ref).abs().max() / ref.abs().max())
                row[f"{kname}_ms"] = graph_ms([lambda i=i, fn=fn: fn(i) for i in range(n)])
                row[f"{kname}_eager_ms"] = do_bench(lambda fn=fn: fn(0), return_mode="median")
                row[f"{kname}_speedup_vs_replay"] = row["replay_ms"] / row[f"{kname}_ms"]
            row["floor_ms"] = verify_bytes(B, T) / bw * 1e3
            for kname in kernels:
                row[f"{kname}_x_floor"] = row[f"{kname}_ms"] / row["floor_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del sets, gathered
    return rows


def bench_commit(batches: list[int], bw: float, fla_replay) -> list[dict]:
    """Commit of ``a`` accepted tokens (root + a - 1 drafts) out of a 16-node verify."""
    rows, T = [], 16
    for B in batches:
        gen = torch.Generator(device=DEV).manual_seed(7 + B)
        state_bytes = B * HV * K * V * 4
        sets = []
        for _ in range(copies_for(3 * state_bytes)):
            q, k, v, g, beta, S0 = layer_inputs(B, T, gen)
            _, delta, G = serial_verify(q, k, v, g, beta, S0, torch.full((B,), T, device=DEV), K**-0.5)
            sets.append((q, k, v, g, beta, S0, delta, G))
        n = len(sets)
        snapshot = torch.randn(B, HV, K, V, device=DEV)  # the accepted node's state saved by verify
        for a in range(1, 9):
            path = torch.arange(a, device=DEV).expand(B, a).contiguous()
            plen = torch.full((B,), a, dtype=torch.int64, device=DEV)
            work = [S.clone() for *_, S, _, _ in sets]
            acc = [tuple(x[:, :a].contiguous() for x in st[:5]) for st in sets]

            def replay(i):
                q, k, v, g, b = acc[i]
                return fla_replay(q, k, v, g=g, beta=b, scale=K**-0.5, initial_state=sets[i][5],
                                  output_final_state=True)

            commits = [LayerCommit(GDNFactorRecord(k=st[1], delta=st[6], G=st[7], conv_x=None), path, plen)
                       for st in sets]
            times = {
                "factor": graph_ms([lambda i=i: flush_commit(work[i], commits[i]) for i in range(n)]),
                "replay": graph_ms([lambda i=i: replay(i) for i in range(n)]),
                "snapshot": graph_ms([lambda i=i: work[i].copy_(snapshot) for i in range(n)]),
            }
            check = sets[0][5].clone()
            flush_commit(check, commits[0])
            replayed = replay(0)[1]
            err = float((check - replayed).abs().max() / replayed.abs().max())
            row = dict(batch=B, accepted=a, input_sets=n, **{f"{m}_ms": t for m, t in times.items()},
                       factor_vs_replay=times["replay"] / times["factor"], factor_max_rel_err=err,
                       floor_ms=(2 * state_bytes + B * a * (H * K * 2 + HV * V * 4 + HV * 4)) / bw * 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del sets
    return rows


def commit_memory(T: int = 17, layers: int = 24) -> dict:
    """Transient speculative bytes per sequence for a ``T``-node verify (16 drafts + root) over
    ``layers`` GDN layers of the 1.3B shape (conv windows excluded: equal for all strategies)."""
    per_node = {
        "factor": H * K * 2 + HV * V * 4 + HV * 4,  # k (bf16), Delta, G
        "replay": H * K * 2 + HV * V * 2 + 2 * HV * 4,  # k, v (bf16), g, beta
        "snapshot": HV * K * V * 4,  # one float32 state per node
    }
    return {n: b * T * layers for n, b in per_node.items()}


def bench_fused(batches: list[int], bw: float) -> list[dict]:
    """Verify with the previous step's commit fused (one state read and write) vs flush then verify."""
    rows = []
    cases = {"chain T=8 (serial)": list(range(-1, 7)), "topk4 depth4 T=32 (parallel)": trees()["topk4 depth4 T=32"],
             "topk2 depth12 T=16 (hybrid)": trees()["topk2 depth12 T=16"]}
    a = 4
    for name, par in cases.items():
        T = len(par)
        for B in batches:
            gen = torch.Generator(device=DEV).manual_seed(B + 3)
            parents = torch.tensor(par, device=DEV).expand(B, T).contiguous()
            mask = inclusive_ancestor_mask(parents)
            plan = hybrid_plan(parents)
            nodes = torch.full((B,), T, dtype=torch.int64, device=DEV)
            path = torch.arange(a, device=DEV).expand(B, a).contiguous()
            plen = torch.full((B,), a, dtype=torch.int64, device=DEV)
            sets = []
            for _ in range(copies_for(verify_bytes(B, T, a))):
                xs = layer_inputs(B, T, gen)
                pq, pk, pv, pg, pbeta, _ = layer_inputs(B, 16, gen)
                _, pdelta, pG = serial_verify(pq, pk, pv, pg, pbeta, xs[5].clone(), torch.full((B,), 16, device=DEV),
                                              K**-0.5)
                sets.append((xs, LayerCommit(GDNFactorRecord(k=pk, delta=pdelta, G=pG, conv_x=None), path, plen)))

            def verify(i, pending):
                xs = sets[i][0]
                if "serial" in name:
                    return serial_verify(*xs, nodes, K**-0.5, pending=pending)
                if "parallel" in name:
                    return tree_verify(*xs, mask, K**-0.5, pending=pending)
                return hybrid_verify(*xs, parents, K**-0.5, pending=pending, plan=plan)

            def separate(i):
                flush_commit(sets[i][0][5], sets[i][1])
                return verify(i, None)

            n = len(sets)
            fused_ms = graph_ms([lambda i=i: verify(i, sets[i][1]) for i in range(n)])
            sep_ms = graph_ms([lambda i=i: separate(i) for i in range(n)])
            row = dict(case=name, batch=B, accepted=a, input_sets=n, fused_ms=fused_ms, separate_ms=sep_ms,
                       fused_speedup=sep_ms / fused_ms, fused_floor_ms=verify_bytes(B, T, a) / bw * 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del sets
    return rows


def sweep(batches: list[int]) -> list[dict]:
    """Launch-parameter sweep (``verify.TUNING``): V-tile width and warps per kernel."""
    from specla.mixers.gdn import verify as vk

    rows, scale = [], K**-0.5
    cases = [("serial", "chain T=8"), ("serial", "chain T=16"), ("chain", "chain T=16"), ("chain", "topk4 depth4 T=32"),
             ("chain", "pruned T=64"), ("tree", "topk4 depth4 T=32"), ("tree", "pruned T=16")]
    grid = {"serial": [(bv, w) for bv in (8, 16, 32, 64) for w in (1, 2, 4)],
            "chain": [(bv, w) for bv in (8, 16, 32, 64) for w in (1, 2, 4)],
            "tree": [(bv, w) for bv in (16, 32, 64) for w in (2, 4, 8)]}
    default = {k: dict(v) for k, v in vk.TUNING.items()}
    for kernel, tree in cases:
        par = trees()[tree]
        T = len(par)
        for B in batches:
            gen = torch.Generator(device=DEV).manual_seed(B)
            parents = torch.tensor(par, device=DEV).expand(B, T).contiguous()
            mask, plan = inclusive_ancestor_mask(parents), hybrid_plan(parents)
            nodes = torch.full((B,), T, dtype=torch.int64, device=DEV)
            sets = [layer_inputs(B, T, gen) for _ in range(copies_for(verify_bytes(B, T)))]
            fn = {"serial": lambda i: serial_verify(*sets[i], nodes, scale),
                  "chain": lambda i: hybrid_verify(*sets[i], parents, scale, plan=plan),
                  "tree": lambda i: tree_verify(*sets[i], mask, scale)}[kernel]
            row = dict(kernel=kernel, tree=tree, batch=B)
            for bv, w in grid[kernel]:
                vk.TUNING[kernel] = {"BV": bv, "num_warps": w}
                try:
                    row[f"BV{bv}/w{w}"] = graph_ms([lambda i=i: fn(i) for i in range(len(sets))], reps=10)
                except Exception as err:  # e.g. out of resources: record and go on
                    row[f"BV{bv}/w{w}"] = repr(err)[:80]
            vk.TUNING.update({k: dict(v) for k, v in default.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------------- GLA and Mamba2 (issue 6)
class GLALayer:
    """One FLA GLA-1.3B layer: inputs ``(q, k, v, gk, S0)``, the plugin's kernels, FLA's replay."""

    def __init__(self, H: int = 4, K: int = 256, V: int = 512):
        from fla.ops.gla import fused_recurrent_gla
        from specla.mixers.gla import commit, verify
        from specla.mixers.gla.records import GLAFactorRecord

        self.H, self.K, self.V, self.scale = H, K, V, K**-0.5
        self.kernels, self.flush_commit, self.fla = verify, commit.flush_commit, fused_recurrent_gla
        self.record_type = GLAFactorRecord

    def shape(self) -> dict:
        return dict(H=self.H, K=self.K, V=self.V)

    def inputs(self, B: int, T: int, gen: torch.Generator, act=torch.bfloat16) -> tuple:
        H, K, V = self.H, self.K, self.V
        r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
        return (r(B, T, H, K).to(act), r(B, T, H, K).to(act), r(B, T, H, V).to(act),
                F.logsigmoid(r(B, T, H, K)) / 16, r(B, H, K, V) * 0.1)

    def serial(self, xs, nodes):
        return self.kernels.serial_verify(*xs, nodes, self.scale)  # (o, Gk)

    def parallel(self, xs, mask):
        return self.kernels.tree_verify(*xs, mask, self.scale)

    def records(self, xs, out):  # the factor record: k, v and the path-summed log decay
        return self.record_type(k=xs[1], v=xs[2], Gk=out[1], conv_x=None)

    def flush(self, state, record, path, plen):
        return self.flush_commit(state, LayerCommit(record, path, plen))

    def gather(self, xs, nodes: list[int]) -> tuple:
        """FLA's inputs along ``nodes`` (a root path), gathered beforehand."""
        return tuple(x[:, nodes].contiguous() for x in xs[:4])

    def replay(self, g, S0, final: bool = False):
        q, k, v, gk = g
        return self.fla(q, k, v, gk=gk, scale=self.scale, initial_state=S0, output_final_state=final)

    def skip(self, xs, nodes):  # no skip connection in the recurrence
        return 0.0

    def state_bytes(self, B: int) -> int:
        return B * self.H * self.K * self.V * 4

    def record_bytes(self) -> int:  # per node: k, v (bf16), Gk (f32)
        return self.H * (self.K * 2 + self.V * 2 + self.K * 4)

    def verify_bytes(self, B: int, T: int) -> int:
        H, K, V = self.H, self.K, self.V
        inputs = H * (2 * K * 2 + V * 2 + K * 4)  # q, k, v (bf16), gk
        outputs = H * (V * 2 + K * 4)  # o (bf16), Gk
        return self.state_bytes(B) + B * T * (inputs + outputs)


class Mamba2Layer:
    """One FLA Mamba2-1.3B layer: inputs ``(x, dt, a, Bm, Cm, D, S0)``, the plugin's kernels, and
    FLA's scalar-decay linear attention as the replay (q = C, k = B, v = dt x, g = a, scale 1)."""

    def __init__(self, H: int = 64, P: int = 64, N: int = 128, NG: int = 1):
        from fla.ops.simple_gla import fused_recurrent_simple_gla
        from specla.mixers.mamba2 import commit, verify
        from specla.mixers.mamba2.records import Mamba2FactorRecord

        self.H, self.P, self.N, self.NG = H, P, N, NG
        self.kernels, self.flush_commit, self.fla = verify, commit.flush_commit, fused_recurrent_simple_gla
        self.record_type = Mamba2FactorRecord

    def shape(self) -> dict:
        return dict(H=self.H, P=self.P, N=self.N, NG=self.NG)

    def inputs(self, B: int, T: int, gen: torch.Generator, act=torch.bfloat16) -> tuple:
        H, P, N, NG = self.H, self.P, self.N, self.NG
        r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
        dt = torch.rand(B, T, H, device=DEV, generator=gen) * 0.1 + 0.01  # step sizes after the softplus
        A = -(torch.rand(H, device=DEV, generator=gen) * 15 + 1)  # -exp(A_log), A in [-16, -1]
        return (r(B, T, H, P).to(act), dt, dt * A, r(B, T, NG, N).to(act), r(B, T, NG, N).to(act), r(H),
                r(B, H, N, P) * 0.1)

    def serial(self, xs, nodes):
        return self.kernels.serial_verify(*xs, nodes)  # (y, u, G)

    def parallel(self, xs, mask):
        return self.kernels.tree_verify(*xs, mask)

    def records(self, xs, out):  # the factor record: Bm, u = dt x and the path-summed log decay
        return self.record_type(Bm=xs[3], u=out[1], G=out[2], conv_x=None)

    def flush(self, state, record, path, plen):
        return self.flush_commit(state, LayerCommit(record, path, plen))

    def gather(self, xs, nodes: list[int]) -> tuple:
        """FLA's inputs along ``nodes`` (a root path), gathered beforehand: q = C and k = B
        repeated to the heads, v = dt x, g = dt A."""
        x, dt, a, Bm, Cm = xs[:5]
        heads = lambda m: m[:, nodes].repeat_interleave(self.H // self.NG, dim=2)  # noqa: E731
        return heads(Cm), heads(Bm), (dt[:, nodes, :, None] * x[:, nodes]).to(x.dtype), a[:, nodes].contiguous()

    def replay(self, g, S0, final: bool = False):
        q, k, v, a = g
        return self.fla(q, k, v, g=a, scale=1.0, initial_state=S0, output_final_state=final)

    def skip(self, xs, nodes):  # D x, fused in the kernels, outside FLA's recurrence
        return xs[5][:, None] * xs[0][:, nodes].float()

    def state_bytes(self, B: int) -> int:
        return B * self.H * self.N * self.P * 4

    def record_bytes(self) -> int:  # per node: Bm (bf16), u (f32), G (f32)
        return self.NG * self.N * 2 + self.H * self.P * 4 + self.H * 4

    def verify_bytes(self, B: int, T: int) -> int:
        H, P, N, NG = self.H, self.P, self.N, self.NG
        inputs = H * P * 2 + 2 * H * 4 + 2 * NG * N * 2  # x, dt, a, Bm, Cm
        outputs = H * P * 4 + H * P * 4 + H * 4  # y, u, G
        return self.state_bytes(B) + B * T * (inputs + outputs)


LAYERS = {"gla": GLALayer, "mamba2": Mamba2Layer}


def layer_kernels(layer, par: list[int], B: int) -> dict:
    """The verify kernels of ``layer`` for a batch of ``B`` copies of tree ``par``, as functions of
    one input set: parallel always (``T <= 64``), serial for chains."""
    T = len(par)
    parents = torch.tensor(par, device=DEV).expand(B, T).contiguous()
    mask = inclusive_ancestor_mask(parents)
    kernels = {"parallel": lambda xs: layer.parallel(xs, mask)}
    if par == list(range(-1, T - 1)):
        nodes = torch.full((B,), T, dtype=torch.int64, device=DEV)
        kernels["serial"] = lambda xs: layer.serial(xs, nodes)
    return kernels


def verify_errors(layer, xs, par: list[int], kernels: dict) -> dict:
    """Largest error of each kernel's outputs relative to the largest output of root-to-leaf replay."""
    ref = None
    for path in leaves_paths(par):
        o = layer.replay(layer.gather(xs, path), xs[-1])[0].float() + layer.skip(xs, path)
        if ref is None:
            ref = torch.empty(o.shape[0], len(par), *o.shape[2:], device=DEV)
        ref[:, path] = o
    return {k: float((fn(xs)[0].float() - ref).abs().max() / ref.abs().max()) for k, fn in kernels.items()}


def commit_error(layer, xs, records, a: int) -> float:
    """``flush_commit`` of the first ``a`` chain nodes vs FLA's replay of them (final state)."""
    B = xs[0].shape[0]
    path = torch.arange(a, device=DEV).expand(B, a).contiguous()
    got = layer.flush(xs[-1].clone(), records, path, torch.full((B,), a, dtype=torch.int64, device=DEV))
    ref = layer.replay(layer.gather(xs, list(range(a))), xs[-1], final=True)[1]
    return float((got - ref).abs().max() / ref.abs().max())


def bench_verify_layer(layer, batches: list[int], bw: float) -> list[dict]:
    rows = []
    for name, par in trees().items():
        T, paths = len(par), leaves_paths(par)
        for B in batches:
            gen = torch.Generator(device=DEV).manual_seed(B * 100 + T)
            sets = [layer.inputs(B, T, gen) for _ in range(copies_for(layer.verify_bytes(B, T)))]
            gathered = [[layer.gather(xs, p) for p in paths] for xs in sets]
            kernels = layer_kernels(layer, par, B)
            n = len(sets)
            row = dict(tree=name, T=T, batch=B, paths=len(paths), input_sets=n)
            for kname, err in verify_errors(layer, sets[0], par, kernels).items():
                row[f"{kname}_max_rel_err"] = err
            row["replay_ms"] = graph_ms([lambda i=i: [layer.replay(g, sets[i][-1]) for g in gathered[i]]
                                         for i in range(n)])
            row["floor_ms"] = layer.verify_bytes(B, T) / bw * 1e3
            for kname, fn in kernels.items():
                row[f"{kname}_ms"] = graph_ms([lambda i=i, fn=fn: fn(sets[i]) for i in range(n)])
                row[f"{kname}_eager_ms"] = do_bench(lambda fn=fn: fn(sets[0]), return_mode="median")
                row[f"{kname}_speedup_vs_replay"] = row["replay_ms"] / row[f"{kname}_ms"]
                row[f"{kname}_x_floor"] = row[f"{kname}_ms"] / row["floor_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del sets, gathered
    return rows


def bench_commit_layer(layer, batches: list[int], bw: float) -> list[dict]:
    """Commit of ``a`` accepted tokens (root + a - 1 drafts) out of a 16-node chain verify."""
    rows, T = [], 16
    for B in batches:
        gen = torch.Generator(device=DEV).manual_seed(7 + B)
        nodes = torch.full((B,), T, dtype=torch.int64, device=DEV)
        sets = []
        for _ in range(copies_for(3 * layer.state_bytes(B))):
            xs = layer.inputs(B, T, gen)
            sets.append((xs, layer.records(xs, layer.serial(xs, nodes))))
        n = len(sets)
        snapshot = torch.randn_like(sets[0][0][-1])  # the accepted node's state saved by verify
        for a in range(1, 9):
            path = torch.arange(a, device=DEV).expand(B, a).contiguous()
            plen = torch.full((B,), a, dtype=torch.int64, device=DEV)
            work = [xs[-1].clone() for xs, _ in sets]
            acc = [layer.gather(xs, list(range(a))) for xs, _ in sets]
            times = {
                "factor": graph_ms([lambda i=i: layer.flush(work[i], sets[i][1], path, plen) for i in range(n)]),
                "replay": graph_ms([lambda i=i: layer.replay(acc[i], sets[i][0][-1], final=True) for i in range(n)]),
                "snapshot": graph_ms([lambda i=i: work[i].copy_(snapshot) for i in range(n)]),
            }
            state = layer.state_bytes(B)
            row = dict(batch=B, accepted=a, input_sets=n, **{f"{m}_ms": t for m, t in times.items()},
                       factor_vs_replay=times["replay"] / times["factor"],
                       factor_max_rel_err=commit_error(layer, *sets[0], a),
                       floor_ms=(2 * state + B * a * layer.record_bytes()) / bw * 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del sets
    return rows


def markdown(report: dict) -> str:
    """The tables of ``BENCHMARKS.md`` from a report."""
    names = [n for n in ("serial", "parallel", "hybrid") if any(f"{n}_ms" in r for r in report["verify"])]
    meta = report["meta"]
    lines = [f"{report.get('plugin', 'gdn')} {report['shape']}; GPU: {meta['device']}, {meta['date']}; "
             f"copy bandwidth {report['bandwidth_GBps']:.0f} GB/s.", "",
             "| tree | T | batch | replay ms | " + " | ".join(f"{n} ms" for n in names) + " | best vs replay | "
             "best x floor |", "|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    for r in report["verify"]:
        best = min((n for n in names if f"{n}_ms" in r), key=lambda n: r[f"{n}_ms"])
        cells = " | ".join(f"{r[f'{n}_ms']:.3f}" if f"{n}_ms" in r else "n/a" for n in names)
        lines.append(f"| {r['tree']} | {r['T']} | {r['batch']} | {r['replay_ms']:.3f} | {cells} | "
                     f"{r[f'{best}_speedup_vs_replay']:.2f}x ({best}) | {r[f'{best}_x_floor']:.2f} |")
    lines += ["", "| batch | accepted | factor ms | replay ms | snapshot ms | factor vs replay |", "|---|---|---|---|---|---|"]
    for r in report["commit"]:
        lines.append(f"| {r['batch']} | {r['accepted']} | {r['factor_ms']:.4f} | {r['replay_ms']:.4f} | "
                     f"{r['snapshot_ms']:.4f} | {r['factor_vs_replay']:.2f}x |")
    if report["fused"]:
        lines += ["", "| case | batch | fused ms | separate ms | fused speedup | fused x floor |",
                  "|---|---|---|---|---|---|"]
    for r in report["fused"]:
        lines.append(f"| {r['case']} | {r['batch']} | {r['fused_ms']:.4f} | {r['separate_ms']:.4f} | "
                     f"{r['fused_speedup']:.2f}x | {r['fused_ms'] / r['fused_floor_ms']:.2f} |")
    mem = report.get("commit_memory_bytes_per_sequence")
    if mem:
        lines += ["", "Transient memory per sequence (17-node verify, 24 layers): " +
                  ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in mem.items())]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugin", default="gdn", choices=["gdn", *LAYERS])
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--only", default=None, help="any of verify,commit,fused,sweep (fused and sweep: gdn only); "
                    "default: verify,commit,fused for gdn, verify,commit otherwise")
    args = add_allow_dirty(ap).parse_args()
    if not torch.cuda.is_available():  # every study times CUDA graphs
        ap.exit(2, f"{ap.prog}: error: needs a CUDA GPU; torch sees none\n")
    batches = [int(b) for b in args.batches.split(",")]
    only = (args.only or ("verify,commit,fused" if args.plugin == "gdn" else "verify,commit")).split(",")
    if args.plugin != "gdn" and not set(only) <= {"verify", "commit"}:
        ap.error(f"--plugin {args.plugin} has only the verify and commit studies")
    meta = provenance("cuda", args.allow_dirty)
    bw = copy_bandwidth()
    report = dict(meta=meta, plugin=args.plugin, bandwidth_GBps=bw / 1e9)
    if args.plugin == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        report.update(shape=dict(H=H, HV=HV, K=K, V=V), commit_memory_bytes_per_sequence=commit_memory())
        report["verify"] = bench_verify(batches, bw, fused_recurrent_gated_delta_rule) if "verify" in only else []
        report["commit"] = bench_commit(batches, bw, fused_recurrent_gated_delta_rule) if "commit" in only else []
        report["fused"] = bench_fused(batches, bw) if "fused" in only else []
        report["sweep"] = sweep(batches) if "sweep" in only else []
    else:
        layer = LAYERS[args.plugin]()
        report["shape"] = layer.shape()
        report["verify"] = bench_verify_layer(layer, batches, bw) if "verify" in only else []
        report["commit"] = bench_commit_layer(layer, batches, bw) if "commit" in only else []
        report["fused"], report["sweep"] = [], []
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(markdown(report))


if __name__ == "__main__":
    main()
