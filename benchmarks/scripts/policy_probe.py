"""The budget policy against fixed budgets and plain decoding at the ``small`` target's shape, per
batch size (issue 16, target 6: never slower than plain decoding).

    python benchmarks/scripts/policy_probe.py [--batches 1,8,32,64] [--repeats 3] > policy.jsonl

A randomly initialised GDN model of the ``small`` preset's shape, bfloat16, with the embedding trick
and the oracle drafter of ``benchmarks/e2e.py`` (acceptance drawn from the ``small`` target's
measured GSM8K profiles, tree and chain each its own; a random EAGLE head of this width drafts a
full tree every step and its output is discarded, so drafting costs what it costs). Prompts of
random lengths (16 to 128 tokens), 128 new tokens; sequences finish at different steps, as in a
suite. Rows per batch: plain decoding (N 0), the tree (N 15, depth 6, top-k 4) and the chain
(N 6) with fixed budgets, and the tree under ``budget_policy="adaptive"`` (its candidates: the
tree, its chain, whose steps draw from the chain profile, and plain decoding); CUDA graphs. One
JSON line per row: tokens/s (median of ``--repeats`` calls after warm-up calls, until one records no
graph: steady state; prefill included) and each call's, its ratio to plain decoding's, and the last timed call's
:class:`~specla.engine.RunStats` (steps, plain and chain steps, budget switches and their
seconds, graphs recorded, prefill), and for the adaptive row what its policy measured (tokens
per sequence-step and step milliseconds per batch bucket, per candidate). A cost model of the
policy's choices, not a speed claim for a trained drafter.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import CHAIN, TREE, ProfileDrafter, measured_profile  # noqa: E402
from provenance import add_allow_dirty, print_meta  # noqa: E402
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM  # noqa: E402
from train_target import PRESETS  # noqa: E402

from specla import SpecDecoder  # noqa: E402
from specla.drafters.eagle import EagleDrafter, EagleHead  # noqa: E402

PROFILES = "benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json:gsm8k/eagle-"
ROWS = {"ar": (dict(num_draft_tokens=0), "fixed"), "tree": (TREE, "fixed"), "chain": (CHAIN, "fixed"),
        "tree-adaptive": (TREE, "adaptive")}
STATS = ("steps", "plain_steps", "chain_steps", "budget_switches", "switch_s", "graphs_recorded", "prefill_s", "wall_s",
         "mean_accepted_tokens")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-warmup", type=int, default=8, help="warm-up calls at most (until one records no graph)")
    p.add_argument("--device", default="cuda", help="cpu: a check of the script (float32, no graphs)")
    p.add_argument("--preset", default="small", choices=("tiny", "small"),
                   help="the model shape: a GDN preset of train_target.py")
    a = add_allow_dirty(p).parse_args()
    print_meta(a.device, a.allow_dirty)
    cuda = a.device == "cuda"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(vocab_size=32000, **PRESETS[a.preset]["model"]))
    model = model.to(a.device, dtype).eval()
    with torch.no_grad():  # the embedding trick of e2e.py: the greedy token is the input token
        emb = model.get_input_embeddings().weight
        emb.mul_(32)
        if model.lm_head.weight is not emb:  # the preset may tie them already
            model.lm_head.weight.copy_(emb)
    head = EagleHead(model.config.hidden_size)
    profiles = {"tree": measured_profile(PROFILES + "tree"), "chain": measured_profile(PROFILES + "chain")}
    for B in (int(x) for x in a.batches.split(",")):
        g = torch.Generator().manual_seed(B)
        lengths = torch.randint(16, 129, (B,), generator=g).tolist()
        prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in lengths]
        base = None
        for name, (budget, policy) in ROWS.items():
            drafter = ProfileDrafter(profiles["chain" if name == "chain" else "tree"], EagleDrafter(head),
                                     chain_profile=profiles["chain"])
            dec = SpecDecoder(model, "gdn", drafter=drafter, config=dict(
                dtype=str(dtype).removeprefix("torch."), device=a.device, max_new_tokens=128, stop_at_eos=False,
                engine=dict(cuda_graphs="on" if cuda else "off", budget_policy=policy), **budget))
            warm = 1  # warm-up calls until one records no graph: the rows finish at other steps
            while dec.generate(prompts).stats.graphs_recorded and warm < a.max_warmup:  # in each call, so
                warm += 1  # the batch sizes (and the policy's budgets) that get a graph vary
            rates, r = [], None
            for _ in range(a.repeats):
                r = dec.generate(prompts)
                rates.append(r.stats.tokens_per_s)
            rate = statistics.median(rates)
            base = rate if name == "ar" else base
            stats = {k: round(getattr(r.stats, k), 4) for k in STATS}
            pol = dec.engine.policy
            seen = {} if pol is None else {  # what the policy measured: per budget N and batch bucket
                f"N{n}": dict(tokens=None if pol.tokens[c] is None else round(pol.tokens[c], 3),
                              step_ms={bb: None if s.seconds[c] is None else round(s.seconds[c] * 1e3, 3)
                                       for bb, s in pol.buckets.items()})
                for c, n in enumerate(pol.budgets)}
            print(json.dumps(dict(batch=B, row=name, tokens_per_s=round(rate, 1), vs_ar=round(rate / base, 3),
                                  calls=[round(x, 1) for x in rates], warmup_calls=warm, last_call=stats,
                                  **({"policy": seen} if seen else {}))), flush=True)
            del dec
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
