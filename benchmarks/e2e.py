"""End-to-end speed at the GDN-1.3B shape on one GPU (issue 5; BENCHMARKS.md section 5).

    python benchmarks/e2e.py --out DIR [--studies step,oracle,baselines] [--batches 1,8,32,64]
    python benchmarks/e2e.py --out DIR --replot e2e.json [e2e.json ...]   # tables and plots again

The target is FLA's ``GatedDeltaNetForCausalLM`` at the GDN-1.3B shape (hidden 2048, 24 layers, 8
heads of dim 256, expand_v 1, vocab 32000) in bfloat16 with random weights, except that the input
embedding is scaled by ``--embed-scale`` (default 32) and copied into the LM head: the last-layer
feature is then dominated by the input token's embedding, so the greedy next token is the input
token itself with a margin bf16 rounding cannot flip. That fixes the greedy continuation (the root
token, repeated) without changing any cost, which lets an *oracle drafter* set acceptance exactly:
each step it draws the number of correct drafts ``a`` from a profile, proposes ``a`` right tokens
then wrong ones along a chain of depth ``D``, and fills the budget ``N`` with wrong siblings. With
``--eagle`` (default) it also runs a random EAGLE head of this shape over a full draft tree each
step, whose output it discards, so the drafter's cost is counted.

Studies (each one command; every figure is a median over ``--repeats`` timed runs after a warm-up):

- ``step``: ms per decoding step (CUDA graphs, no drafter compute) for budgets ``N`` and batches;
  ``N = 0`` is specla's graph-captured autoregressive step; ratios to it in the same run.
- ``oracle``: tokens/s of SpecLA chain (N = D = 6) and tree (N = 15 drafts, 16 nodes with the
  root, D = 6) against the graph AR baseline, for per-token acceptance ``alpha`` (profile
  ``P(a >= k) = alpha^k`` along the main path; a tree's other nodes are pure cost here, so at
  equal ``alpha`` a tree cannot beat a chain)
  and for the profiles measured with the ``small`` target on GSM8K, each drafter its own
  (``--profile`` for the tree, ``--chain-profile`` for the chain), per batch.
- ``baselines``: at the GSM8K profile, one table per batch with: transformers ``generate``
  (eager, batch 1 and 8 only: it is far slower than the graph rows), specla AR (graph), FLA's
  own model decoding one token with its cache in a CUDA graph (:func:`fla_graph_step`; every row's
  ``vs_best_ar`` is against the faster of the two AR rows), speculative tree with
  ``snapshot`` and ``replay`` commit, FLA-SD (chain; verify's recurrence and the replay commit on
  FLA's stock kernel, :func:`fla_sd_verify`), SpecLA chain and tree (``factor``); ``--core-rows``
  keeps the two AR rows and SpecLA's chain and tree; each row's greedy output
  compared token for token with the AR row (``exact``: the fraction of sequences equal to it;
  transformers ``generate``'s ``--hf-tokens`` against the AR row's first ones); per sequence, the
  bytes one verify's records hold
  (what commit needs: factor records, snapshot states or replay inputs) and the peak memory above
  the model (CUDA-graph pools and static state included). With the embedding trick the greedy
  token is the input token whatever the recurrent state holds, so ``exact`` catches wrong tokens
  and lost or reordered sequences, not a wrong state (the conformance tests check states).

Writes ``DIR/e2e.json`` (every row; ``meta``: commit, GPU, library versions, date and command,
benchmarks/provenance.py), ``DIR/e2e.md`` (tables) and ``DIR/*.png`` (plots; matplotlib, the
``bench`` extra: ``pip install 'specla[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from specla import SpecConfig
from specla.api import SpecDecoder
from specla.drafters.eagle import EagleDrafter, EagleHead
from specla.cuda.capture import record_graph
from specla.interfaces import Drafter
from specla.tree import DraftTree
from specla.mixers.gdn.mixer import GDNMixer
from specla.mixers.gdn.reference import expand_heads, tree_gdn
from specla.model.adapter import ModelAdapter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import add_allow_dirty, provenance  # noqa: E402

VOCAB = 32000
CHAIN = dict(num_draft_tokens=6, max_depth=6, top_k=1)
FLA_SD = "FLA-SD: chain, replay on FLA kernels"
FLA_GRAPH = "AR, FLA model in a CUDA graph"
# 15 drafts + the root = 16 nodes: one 16-row tile of the parallel kernel (17 nodes double the tile
# and more than double its time: docs/tuning.md, "Tree size of the end-to-end study")
TREE = dict(num_draft_tokens=15, max_depth=6, top_k=4)


# GDN-1.3B's layer shape (the layer count is a flag: 24)
GDN13B_SHAPE = dict(hidden_size=2048, num_heads=8, head_dim=256, expand_v=1, tie_word_embeddings=False)


def gdn13b(layers: int, embed_scale: float, seed: int = 0):
    """The GDN-1.3B-shaped FLA model (see the module docstring), bf16, on the GPU."""
    import fla  # noqa: F401  (registers the model classes)
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    cfg = GatedDeltaNetConfig(vocab_size=VOCAB, num_hidden_layers=layers, **GDN13B_SHAPE)
    torch.manual_seed(seed)
    model = GatedDeltaNetForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # untied like GDN-1.3B (the head is read as its own matrix), same values
        model.model.embeddings.weight.mul_(embed_scale)
        model.lm_head.weight.copy_(model.model.embeddings.weight)
    return model


def fla_recurrence(q, k, v, g, beta, S0, mask, scale, records):
    """FLA-SD's verify recurrence (:attr:`specla.mixers.gdn.mixer.GDNMixer.recurrence`): FLA's stock
    ``fused_recurrent_gated_delta_rule`` over the chain as one sequence, from the committed state,
    for ``replay`` passes; prefill (factor records) stays on specla's path (it is not timed)."""
    if records != "replay":
        return tree_gdn(q, k, v, g, beta, S0, mask, scale)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    # q, k as they are (FLA upcasts every load; its output o takes v's dtype, as in FLA)
    HV = v.shape[2]
    q, k = (expand_heads(x, HV) for x in (q, k))
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=S0,
                                            output_final_state=False)
    return o.to(S0.dtype), None, None


def fla_replay(S0, k, v, g, beta, path, path_len):
    """FLA-SD's replay commit (:attr:`specla.mixers.gdn.mixer.GDNMixer.replay_commit`): the accepted
    tokens run through FLA's fused recurrent kernel again (``output_final_state``)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    B, P = path.shape
    rows = torch.arange(B, device=path.device)[:, None]
    node = path.clamp(min=0)
    live = (torch.arange(P, device=path.device)[None, :] < path_len[:, None])[..., None]  # [B, P, 1]
    v = v[rows, node]
    k = expand_heads(k[rows, node], v.shape[2])
    g = torch.where(live, g[rows, node], 0.0)  # decay 1 and no update past the path's end
    beta = torch.where(live, beta[rows, node], 0.0)
    _, S = fused_recurrent_gated_delta_rule(k, k, v, g=g, beta=beta, scale=1.0, initial_state=S0,
                                            output_final_state=True)
    return S.to(S0.dtype)


def fla_sd_verify(adapter: ModelAdapter, tree: DraftTree):
    """The FLA-SD baseline's verify (the SpecLA paper's comparison), bound to a GDN decoder's
    adapter by :func:`use_fla_sd`: chain drafts whose verify runs the recurrence with FLA's stock
    ``fused_recurrent_gated_delta_rule`` (the chain as a sequence, from the committed state,
    :func:`fla_recurrence`), and a replay commit that runs the accepted tokens through the same
    FLA kernel again (:func:`fla_replay`). The rest of the layer (projections, conv, norms) is
    specla's reference path, as in the snapshot and replay rows. Refuses branching drafts (FLA's
    kernel would read them as one chain); checked on the host when not recording (a recorded
    step's drafts come from a chain drafter).

    Raises:
        ValueError: a branching tree.
    """
    if not adapter.static_shapes:
        n = tree.parents.shape[1]
        chain = torch.arange(-1, n - 1, device=tree.parents.device).expand_as(tree.parents)
        valid = torch.arange(n, device=tree.parents.device)[None, :] < tree.num_nodes.to(tree.parents.device)[:, None]
        if bool(((tree.parents != chain) & valid).any()):
            raise ValueError("FLA-SD verifies chains only: the drafter proposed a branching tree")
    return ModelAdapter._verify(adapter, tree)


def use_fla_sd(dec: SpecDecoder) -> SpecDecoder:
    """Turn a GDN decoder with ``commit="replay"`` and chain drafts into the FLA-SD baseline
    (:func:`fla_sd_verify`), before its first step.

    Raises:
        ValueError: the decoder drafts trees, or does not commit by replay.
    """
    cfg = dec.config
    if cfg.top_k != 1 or cfg.engine.commit != "replay" or not all(isinstance(m, GDNMixer) for m in dec.adapter.mixers):
        raise ValueError("FLA-SD needs a GDN decoder with chain drafts (top_k=1) and commit='replay'")
    dec.adapter._verify = types.MethodType(fla_sd_verify, dec.adapter)  # same state, the chain check added
    for m in dec.adapter.mixers:  # the recurrence and the replay commit on FLA's kernel
        m.recurrence, m.replay_commit = fla_recurrence, fla_replay
    return dec


class ProfileDrafter(Drafter):
    """The oracle drafter of the module docstring, on the device (CUDA-graph friendly).

    Args:
        profile: ``P(a)`` for ``a = 0..D`` correct drafts per step (normalised here).
        eagle: an EAGLE drafter whose tree is computed and discarded each step (its cost), or
            ``None``.
        chain_profile: the profile of the steps whose configuration is a chain (``top_k`` 1:
            the budget policy's chain candidate); default ``profile``.
    """

    name = "oracle-profile"
    device_proposals = True

    def __init__(self, profile: list[float], eagle: EagleDrafter | None = None,
                 chain_profile: list[float] | None = None):
        self.eagle, self.adapter, self.profile = eagle, None, list(profile)
        self.chain_profile = None if chain_profile is None else list(chain_profile)
        self.cdf: torch.Tensor | None = None  # [D + 1] cumulative profile on the device, from bind
        self.chain_cdf: torch.Tensor | None = None  # the same for chain steps, from bind

    def set_profile(self, profile: list[float]) -> None:
        """Change the profile in place (recorded graphs read the same tensor)."""
        self.profile = list(profile)
        p = torch.tensor(profile, dtype=torch.float64)
        self.cdf.copy_((p / p.sum()).cumsum(0).to(self.cdf.device, self.cdf.dtype))

    def bind(self, adapter) -> None:
        self.adapter = adapter
        self.cdf = torch.zeros(len(self.profile), dtype=torch.float32, device=adapter.device)
        self.set_profile(self.profile)
        if self.chain_profile is not None:
            p = torch.tensor(self.chain_profile, dtype=torch.float64)
            self.chain_cdf = (p / p.sum()).cumsum(0).to(adapter.device, torch.float32)
        if self.eagle is not None:
            self.eagle.bind(adapter)

    def reset(self, prompts) -> None:
        if self.eagle is not None:
            self.eagle.reset(prompts)

    def propose_on_device(self, roots, config) -> DraftTree:
        if self.eagle is not None:
            self.eagle.propose_on_device(roots, config)  # counted, then discarded
        B, dev = roots.shape[0], roots.device
        N, D = config.num_draft_tokens, min(config.max_depth, config.num_draft_tokens)
        cdf = self.chain_cdf if config.top_k == 1 and self.chain_cdf is not None else self.cdf
        a = (torch.rand(B, device=dev)[:, None] > cdf[None, :-1]).sum(1)  # correct drafts this step
        depth = torch.arange(D, device=dev)
        V = self.adapter.vocab_size
        chain = torch.where(depth[None, :] < a[:, None], roots[:, None], (roots[:, None] + 1) % V)
        extra = (roots[:, None] + 2 + torch.arange(N - D, device=dev)[None, :]) % V  # wrong siblings
        tokens = torch.cat([chain, extra], 1)
        parents = torch.cat([depth - 1, torch.full((N - D,), -1, dtype=torch.int64, device=dev)]).expand(B, N).contiguous()
        return DraftTree.trusted(tokens, parents, torch.full((B,), N, dtype=torch.int64, device=dev))

    def propose(self, contexts, config) -> DraftTree:
        roots = torch.tensor([c[-1] for c in contexts], device=self.adapter.device)
        tree = self.propose_on_device(roots, config)
        return DraftTree(tree.tokens.cpu(), tree.parents.cpu(), tree.num_nodes.cpu())

    def on_commit(self, acceptance, out) -> None:
        if self.eagle is not None:
            self.eagle.on_commit(acceptance, out)

    def select(self, index) -> None:
        if self.eagle is not None:
            self.eagle.select(index)

    def graph_state(self):
        return self.eagle.graph_state() if self.eagle is not None else []

    def set_graph_state(self, tensors) -> None:
        if self.eagle is not None:
            self.eagle.set_graph_state(tensors)


def geometric(alpha: float, D: int) -> list[float]:
    """``P(a)`` with ``P(a >= k) = alpha^k``, ``a <= D``."""
    return [alpha**a * (1 - alpha) for a in range(D)] + [alpha**D]


def alpha_for_mean(mean: float, D: int) -> float:
    """The per-token acceptance ``alpha`` of :func:`geometric` whose mean accepted drafts per step,
    ``sum_{k=1..D} alpha^k``, is ``mean`` (bisection to 1e-12).

    Raises:
        ValueError: ``mean`` outside ``[0, D]``.
    """
    if not 0 <= mean <= D:
        raise ValueError(f"a mean of {mean} accepted drafts is outside 0..{D} (depth {D})")
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**k for k in range(1, D + 1)) < mean else (lo, mid)
    return (lo + hi) / 2


class Harness:
    """Builds decoders on one model and times them."""

    def __init__(self, args):
        self.args = args
        self.model = gdn13b(args.layers, args.embed_scale)
        self.params = sum(p.numel() for p in self.model.parameters())
        g = torch.Generator().manual_seed(0)
        self.prompts = torch.randint(0, VOCAB, (max(args.batches), args.prompt_len), generator=g).tolist()
        self.head = EagleHead(2048) if args.eagle else None
        self.rows: list[dict] = []
        self.dump = None

    def decoder(self, tree: dict, commit: str = "factor", graphs: str = "on", profile=None, eagle: bool = True,
                fla_sd: bool = False):
        """A SpecDecoder (its graphs are kept with it) with an oracle drafter (``fla_sd``: the
        FLA-SD baseline, :func:`use_fla_sd`)."""
        cfg = SpecConfig(device="cuda", dtype="bfloat16", stop_at_eos=False, max_new_tokens=self.args.tokens,
                         engine=dict(commit=commit, cuda_graphs=graphs, budget_policy="fixed"),
                         **tree)  # the row's own budget
        drafter = ProfileDrafter(profile or geometric(0.0, cfg.max_depth),
                                 EagleDrafter(self.head) if (eagle and self.head is not None and tree["num_draft_tokens"])
                                 else None)
        dec = SpecDecoder(self.model, "gdn", drafter=drafter, config=cfg)
        return use_fla_sd(dec) if fla_sd else dec

    def time(self, dec: SpecDecoder, B: int) -> dict:
        """Warm-up (records the graphs), then ``repeats`` timed runs: medians of decode time
        (prefill excluded), tokens/s, ms per step, accepted per step; peak memory above the
        model during all of them (graph pools included), per sequence."""
        prompts = self.prompts[:B]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        dec.generate(prompts)
        runs = []
        for _ in range(self.args.repeats):
            r = dec.generate(prompts)
            decode_s = r.stats.wall_s - r.stats.prefill_s
            runs.append((decode_s, r))
        peak = torch.cuda.max_memory_allocated() - base
        decode_s = statistics.median(s for s, _ in runs)
        r = runs[0][1]
        return dict(B=B, decode_ms=decode_s * 1e3, tokens_per_s=r.stats.generated_tokens / decode_s,
                    ms_per_step=decode_s / r.stats.steps * 1e3, steps=r.stats.steps,
                    accepted_per_step=r.stats.mean_accepted_tokens, peak_mib_per_seq=peak / B / 2**20,
                    record_mib_per_seq=self.record_mib(dec, 1), outputs=r.outputs)

    @staticmethod
    def record_mib(dec: SpecDecoder, B: int) -> float:
        """MiB per sequence held by one verify's records (all layers), from an eager verify of a
        full tree after the timed runs."""
        ad, cfg = dec.adapter, dec.config
        ad.prefill([[1, 2]] * B)
        tree = DraftTree.empty(B, ad.device)
        if cfg.num_draft_tokens:
            dec.drafter.reset([[1, 2]] * B)
            tree = dec.drafter.propose_on_device(ad.roots, cfg)
        out = ad.verify(tree)
        return sum(r.nbytes_per_sequence() for r in out.records) / 2**20

    def add(self, study: str, **row) -> dict:
        row = dict(study=study, **row)
        row.pop("outputs", None)
        self.rows.append(row)
        if self.dump is not None:  # every row on disk as soon as it is measured
            self.dump(self.rows)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        return row

    # ------------------------------------------------------------------ studies
    def step_study(self) -> None:
        for B in self.args.batches:
            base = None
            for N in self.args.budgets:
                tree = dict(num_draft_tokens=N, max_depth=max(N, 1), top_k=1) if N else dict(num_draft_tokens=0)
                dec = self.decoder(tree, eagle=False)
                t = self.time(dec, B)
                base = t["ms_per_step"] if N == 0 else base
                self.add("step", N=N, B=B, ms_per_step=t["ms_per_step"], vs_ar_step=t["ms_per_step"] / base)
                del dec

    def oracle_study(self, profiles_measured: dict[str, list[float]]) -> None:
        for B in self.args.batches:
            ar = self.time(self.decoder(dict(num_draft_tokens=0)), B)
            self.add("oracle", B=B, drafter="AR (graph)", profile="-", tokens_per_s=ar["tokens_per_s"], speedup=1.0,
                     accepted_per_step=0.0)
            for name, tree in (("SpecLA chain", CHAIN), ("SpecLA tree", TREE)):
                dec = self.decoder(tree)
                profiles = [(f"alpha={a}", geometric(a, 6)) for a in self.args.alphas]
                profiles.append(("gsm8k-small (own drafter)", profiles_measured[name]))
                for pname, prof in profiles:
                    dec.drafter.set_profile(prof)
                    t = self.time(dec, B)
                    self.add("oracle", B=B, drafter=name, profile=pname, tokens_per_s=t["tokens_per_s"],
                             speedup=t["tokens_per_s"] / ar["tokens_per_s"], accepted_per_step=t["accepted_per_step"],
                             ms_per_step=t["ms_per_step"])
                del dec

    def baselines(self, profiles: dict[str, list[float]]) -> None:
        for B in self.args.batches:
            ar = self.time(self.decoder(dict(num_draft_tokens=0)), B)
            ref = ar["outputs"]
            self.add("baselines", B=B, row="AR, specla graph", tokens_per_s=ar["tokens_per_s"], vs_ar_graph=1.0,
                     ms_per_step=ar["ms_per_step"], peak_mib_per_seq=ar["peak_mib_per_seq"],
                     record_mib_per_seq=ar["record_mib_per_seq"], exact=1.0)
            fla = self.fla_graph(B)
            best = max(ar["tokens_per_s"], fla["tokens_per_s"])  # every ratio against the faster AR
            self.rows[-1]["vs_best_ar"] = ar["tokens_per_s"] / best
            self.add("baselines", B=B, row=FLA_GRAPH, vs_ar_graph=fla["tokens_per_s"] / ar["tokens_per_s"],
                     vs_best_ar=fla["tokens_per_s"] / best, **fla)
            if B <= 8 and not self.args.core_rows:
                self.add("baselines", B=B, row="AR, transformers generate (eager)",
                         **self.hf_generate(B, ar["tokens_per_s"], ref))
            for name, tree, commit in (("spec tree, snapshot commit", TREE, "snapshot"),
                                       ("spec tree, replay commit", TREE, "replay"),
                                       (FLA_SD, CHAIN, "replay"),
                                       ("SpecLA chain", CHAIN, "factor"), ("SpecLA tree", TREE, "factor")):
                if self.args.core_rows and name not in ("SpecLA chain", "SpecLA tree"):
                    continue
                prof = profiles["SpecLA chain" if tree is CHAIN else "SpecLA tree"]
                t = self.time(self.decoder(tree, commit=commit, profile=prof, fla_sd=name == FLA_SD), B)
                exact = exact_rate(t["outputs"], ref)
                self.add("baselines", B=B, row=name, tokens_per_s=t["tokens_per_s"],
                         vs_ar_graph=t["tokens_per_s"] / ar["tokens_per_s"], vs_best_ar=t["tokens_per_s"] / best,
                         ms_per_step=t["ms_per_step"],
                         accepted_per_step=t["accepted_per_step"], peak_mib_per_seq=t["peak_mib_per_seq"],
                         record_mib_per_seq=t["record_mib_per_seq"], exact=exact)

    def fla_graph(self, B: int) -> dict:
        """FLA's own model decoding one token per sequence with its cache, the forward recorded
        in a CUDA graph after a prefill of the row's prompts (:func:`fla_graph_step`): ms per
        step and tokens/s (``B`` tokens per step; decode only, like the other rows). Its state
        is the captured cache's, so its tokens are not compared (``exact`` is not measured)."""
        ms, kernels = fla_graph_step(self.model, self.prompts[:B])
        return dict(tokens_per_s=B / ms * 1e3, ms_per_step=ms, kernels_per_step=kernels)

    def hf_generate(self, B: int, ar_graph_tps: float, ref: list[list[int]]) -> dict:
        """transformers ``generate`` (greedy, eager FLA model, its cache), ``--hf-tokens`` new
        tokens; ``exact``: :func:`exact_rate` of the warm-up run's tokens against ``ref`` (the AR
        row's outputs). Raises ValueError: an output longer than its reference."""
        prompts, n = self.prompts[:B], self.args.hf_tokens
        dev = next(self.model.parameters()).device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        exact = exact_rate(hf_generate_outputs(self.model, prompts, n), ref)
        ids = torch.tensor(prompts, device=dev)
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)
        with torch.no_grad():
            times = []
            for _ in range(self.args.repeats):
                sync()
                t = time.perf_counter()
                self.model.generate(ids, **kw)
                sync()
                times.append(time.perf_counter() - t)
        tps = B * n / statistics.median(times)
        return dict(tokens_per_s=tps, vs_ar_graph=tps / ar_graph_tps, ms_per_step=statistics.median(times) / n * 1e3,
                    exact=exact)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, skip: int = 0) -> float:
    """Median device ms of one replay of ``graph`` over ``replays`` replays (CUDA events), after
    ``skip`` untimed ones."""
    times = []
    for _ in range(skip + replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[skip:])


def graph_time(fn, replays: int = 50, recorded: torch.cuda.CUDAGraph | None = None,
               by_name: dict | None = None) -> tuple[float, int]:
    """``fn`` recorded in a CUDA graph (:func:`specla.cuda.capture.record_graph`; or the ``recorded``
    graph as it is), replayed ``replays`` times: the median device ms per replay
    (:func:`replay_ms`) and the kernels one replay launches (torch profiler). The graph is kept
    alive here: a later graph may read ``fn``'s outputs. ``by_name``: filled with each kernel's
    name (its first 90 characters) -> ``[launches, device µs]`` in the profiled replay, most
    time first."""
    from torch.profiler import ProfilerActivity, profile

    g = recorded
    if g is None:
        g = record_graph(fn, "cuda")
        _GRAPHS.append(g)
    ms = replay_ms(g, replays)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    if by_name is not None:
        for e in sorted(events, key=lambda e: -e.self_device_time_total):
            entry = by_name.setdefault(e.key[:90], [0, 0.0])
            entry[0] += e.count
            entry[1] = round(entry[1] + e.self_device_time_total, 1)
    return ms, sum(e.count for e in events)


_GRAPHS: list = []  # recorded graphs stay alive: a later graph may read an earlier one's outputs


def fla_graph_step(model, prompts: list[list[int]], replays: int = 50) -> tuple[float, int]:
    """The plain-decoding baseline of the measuring protocol (docs/DESIGN.md): FLA's model
    forward of one token per sequence with its cache (``use_cache=True``), after a prefill of
    ``prompts`` (one length), recorded in a CUDA graph: ``(ms per step, kernels per step)``
    from :func:`graph_time`."""
    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return graph_time(lambda: model(input_ids=tok, past_key_values=cache, use_cache=True), replays)


def hf_generate_outputs(model, prompts: list[list[int]], n: int, use_cache: bool = True) -> list[list[int]]:
    """Greedy transformers ``generate`` of exactly ``n`` new tokens per prompt, one batch.

    Args:
        model: a transformers causal LM (FLA's models are).
        prompts: ``B`` prompts of one length (no padding).
        n: new tokens per prompt.
        use_cache: passed to ``generate``; FLA 0.6's cached ``generate`` restarts from an empty
            state at every step with transformers >= 5.24 (docs/usage.md), ``False`` re-reads the
            whole sequence each step.
    Returns:
        ``B`` lists of ``n`` token ids.
    Raises:
        ValueError: prompts of different lengths.
    """
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("hf_generate_outputs takes prompts of one length (no padding)")
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=use_cache)
    return out[:, ids.shape[1]:].tolist()


def exact_rate(outputs: list[list[int]], ref: list[list[int]]) -> float:
    """The fraction of sequences whose output equals its reference cut to the output's length
    (a row of ``--hf-tokens`` against the AR row's ``--tokens``).

    Raises:
        ValueError: different numbers of sequences, or an output longer than its reference.
    """
    if len(outputs) != len(ref):
        raise ValueError(f"{len(outputs)} outputs against {len(ref)} references")
    if any(len(o) > len(r) for o, r in zip(outputs, ref)):
        raise ValueError("an output is longer than its reference: it cannot be checked")
    return sum(o == r[: len(o)] for o, r in zip(outputs, ref)) / len(ref)


PUBLISHED = Path(__file__).resolve().parent / "profiles" / "published.json"


def measured_profile(spec: str, D: int = 6) -> list[float]:
    """``P(a)`` for ``a = 0..D`` correct drafts per step, normalised, from ``spec``:

    - ``FILE.json:RUN``: the accepted-drafts histogram of ``RUN`` in an acceptance.py report;
    - ``published:NAME``: the histogram of profile ``NAME`` in ``benchmarks/profiles/published.json``
      (a drafter's published acceptance at its own depth ``d``). A deeper one is cut to ``D``
      (``P(a = D)`` takes ``P(a >= D)``: the same drafter drafting ``D`` deep accepts ``min(a, D)``);
      a shallower one gets ``P(a) = 0`` for ``a > d`` (nothing past its depth was measured as accepted).
    - ``geometric:MEAN``: no measurement, :func:`geometric` with the ``alpha`` of
      :func:`alpha_for_mean`: ``MEAN`` accepted drafts per step on average (bonus token not counted).

    Raises:
        ValueError: a report histogram without ``D + 1`` bins; an unknown ``NAME`` (the message
            names the known ones); a ``MEAN`` outside ``[0, D]``.
    """
    if spec.startswith("geometric:"):
        return geometric(alpha_for_mean(float(spec.removeprefix("geometric:")), D), D)
    if spec.startswith("published:"):
        name = spec.removeprefix("published:")
        profiles = json.loads(PUBLISHED.read_text())["profiles"]
        if name not in profiles:
            raise ValueError(f"{spec}: no such published profile; known: {', '.join(sorted(profiles))}")
        hist = profiles[name]["histogram"]
        hist = hist[:D] + [sum(hist[D:])] if len(hist) > D + 1 else hist + [0.0] * (D + 1 - len(hist))
        return [h / sum(hist) for h in hist]
    path, _, run = spec.rpartition(":")
    hist = json.loads(Path(path).read_text())[run]["categories"]["all"]["accepted_histogram"]
    if len(hist) != D + 1:
        raise ValueError(f"{spec}: a histogram of {len(hist)} bins, expected {D + 1} (max_depth {D})")
    return [h / sum(hist) for h in hist]


def tables(rows: list[dict]) -> str:
    """Markdown tables of every study present in ``rows``."""
    out = []
    step = [r for r in rows if r["study"] == "step"]
    if step:
        Ns = sorted({r["N"] for r in step})
        out += ["ms per step (graph, no drafter), ratio to the AR step (N=0) of the same batch", "",
                "| batch | " + " | ".join(f"N={n}" for n in Ns) + " |", "|---" * (len(Ns) + 1) + "|"]
        for B in sorted({r["B"] for r in step}):
            cells = {r["N"]: r for r in step if r["B"] == B}
            out.append(f"| {B} | " + " | ".join(f"{cells[n]['ms_per_step']:.3f} ({cells[n]['vs_ar_step']:.2f}x)"
                                                 if n in cells else "not run" for n in Ns) + " |")
        out.append("")
    orc = [r for r in rows if r["study"] == "oracle" and r["drafter"] != "AR (graph)"]
    if orc:
        profiles = list(dict.fromkeys(r["profile"] for r in orc))
        out += ["speedup over graph AR (accepted drafts per step)", "",
                "| batch | drafter | " + " | ".join(profiles) + " |", "|---" * (len(profiles) + 2) + "|"]
        for B in sorted({r["B"] for r in orc}):
            for d in ("SpecLA chain", "SpecLA tree"):
                cells = {r["profile"]: r for r in orc if r["B"] == B and r["drafter"] == d}
                out.append(f"| {B} | {d} | " + " | ".join(
                    f"{cells[p]['speedup']:.2f}x ({cells[p]['accepted_per_step']:.2f})" if p in cells else "not run"
                    for p in profiles) + " |")
        out.append("")
    base = [r for r in rows if r["study"] == "baselines"]
    if base:
        out += ["| batch | row | tokens/s | vs best AR | vs AR graph | ms/step | accepted/step | records MiB/seq | "
                "peak MiB/seq | exact |", "|---|---|---|---|---|---|---|---|---|---|"]
        nan = float("nan")
        for r in base:
            out.append(f"| {r['B']} | {r['row']} | {r['tokens_per_s']:.0f} | {r.get('vs_best_ar', nan):.2f}x | "
                       f"{r['vs_ar_graph']:.2f}x | "
                       f"{r['ms_per_step']:.3f} | {r.get('accepted_per_step', 0):.2f} | "
                       f"{r.get('record_mib_per_seq', nan):.1f} | {r.get('peak_mib_per_seq', nan):.1f} | "
                       f"{r.get('exact', nan):.3f} |")
    return "\n".join(out)


def plots(rows: list[dict], out: Path) -> None:
    """speedup vs acceptance (per batch) and speedup vs batch (GSM8K profile), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orc = [r for r in rows if r["study"] == "oracle" and r["profile"].startswith("alpha=")]
    if orc:
        fig, ax = plt.subplots(figsize=(6, 4))
        for B in sorted({r["B"] for r in orc}):
            for d, style in (("SpecLA tree", "-o"), ("SpecLA chain", "--s")):
                pts = sorted((float(r["profile"][6:]), r["speedup"]) for r in orc if r["B"] == B and r["drafter"] == d)
                ax.plot(*zip(*pts), style, label=f"{d}, batch {B}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="per-token acceptance probability", ylabel="speedup over graph AR",
               title="GDN-1.3B shape, bf16, H200 (oracle drafter + EAGLE cost)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "speedup_vs_acceptance.png", dpi=120)
    base = [r for r in rows if r["study"] == "baselines"]
    if base:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in dict.fromkeys(r["row"] for r in base):
            pts = sorted((r["B"], r["vs_ar_graph"]) for r in base if r["row"] == name)
            ax.plot(*zip(*pts), "-o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="batch", ylabel="tokens/s relative to graph AR",
               title="GSM8K acceptance profile of the small target")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "speedup_vs_batch.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--studies", default="step,oracle,baselines")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--budgets", default="0,1,2,4,8,16,32,63")
    ap.add_argument("--alphas", default="0.5,0.6,0.7,0.8,0.9,0.95")
    ap.add_argument("--profile", default="benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json:gsm8k/eagle-tree",
                    help="FILE.json:RUN of acceptance.py, published:NAME of benchmarks/profiles/published.json, or "
                    "geometric:MEAN (measured_profile): "
                    "the tree's profile (default: the small target's attention drafter on GSM8K, commit a172ee1)")
    ap.add_argument("--chain-profile", default="benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json"
                    ":gsm8k/eagle-chain", help="FILE.json:RUN, published:NAME or geometric:MEAN: the chain's profile")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--hf-tokens", type=int, default=32, help="new tokens per transformers generate run")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embed-scale", type=float, default=32.0)
    ap.add_argument("--core-rows", action="store_true", help="baselines: only the two AR rows (specla's graph "
                    "step, FLA's model in a CUDA graph) and SpecLA's chain and tree")
    ap.add_argument("--no-eagle", dest="eagle", action="store_false", help="do not count an EAGLE head's cost")
    ap.add_argument("--replot", nargs="+", metavar="JSON", help="write the tables and plots of earlier runs' "
                    "e2e.json files (rows merged) into --out; nothing is measured")
    args = add_allow_dirty(ap).parse_args()
    try:  # the plots: found missing before a run, not after it
        import matplotlib  # noqa: F401
    except ImportError:
        ap.error("the plots need matplotlib, which is not installed: pip install 'specla[bench]'")
    if args.replot:
        rows = [r for f in args.replot for r in json.loads(Path(f).read_text())["rows"]]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "e2e.md").write_text(tables(rows))
        print(tables(rows))
        plots(rows, Path(args.out))
        return
    args.batches = [int(x) for x in args.batches.split(",")]
    args.budgets = [int(x) for x in args.budgets.split(",")]
    args.alphas = [float(x) for x in args.alphas.split(",")]
    studies = args.studies.split(",")
    if not set(studies) <= {"step", "oracle", "baselines"}:
        ap.error(f"--studies: unknown {sorted(set(studies) - {'step', 'oracle', 'baselines'})}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.hf_tokens > args.tokens:  # generate's tokens are checked against the AR row's first ones
        ap.error(f"--hf-tokens {args.hf_tokens} exceeds --tokens {args.tokens}")
    profiles = {"SpecLA tree": measured_profile(args.profile), "SpecLA chain": measured_profile(args.chain_profile)}
    meta = provenance("cuda", args.allow_dirty)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h = Harness(args)
    meta.update(params=h.params, args=dict(vars(args)), gsm8k_profiles=profiles)
    print(json.dumps(meta), flush=True)
    h.dump = lambda rows: (out / "e2e.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for study in studies:
        {"step": h.step_study, "oracle": lambda: h.oracle_study(profiles),
         "baselines": lambda: h.baselines(profiles)}[study]()
    (out / "e2e.md").write_text(tables(h.rows))
    print(tables(h.rows))
    plots(h.rows, out)


if __name__ == "__main__":
    main()
