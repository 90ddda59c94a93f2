"""Acceptance and speedup of a trained target with each drafter on the prompt suites (issues 3 and 7).

    python benchmarks/acceptance.py --model DIR --drafter DIR --prompts ../shared/data/prompts \
        --out acceptance.json [--runs gsm8k/eagle-tree,...] [--time-per-run 60] [--batch-size 16]

Loads the target once and calls :func:`specla.apps.bench.run_bench` (the code of ``specla bench``)
for each run of :data:`RUNS`: a prompt suite, a drafter and its tree settings, a temperature.
Each run decodes its suite speculatively and autoregressively side by side, batch by batch, and
stops starting new batches after ``--time-per-run`` seconds (batches alternate categories, so a
cut run covers as many categories as batches it decoded; the report says how many prompts were
decoded). Every run name and option is checked before the model loads. Writes every report in
one JSON file, keyed by run name, with a ``meta`` block (commit, device, library versions, date,
command: benchmarks/provenance.py), rewritten after each run, so a run cut short by a time limit
keeps the others; prints a markdown table of the ``all`` rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specla import SpecConfig
from specla.apps.bench import run_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import add_allow_dirty, provenance  # noqa: E402

SUITES = {"gsm8k": "gsm8k_test.jsonl", "humaneval": "humaneval.jsonl", "mixed": "specbench_like.jsonl"}
DRAFTERS = {  # drafter source and draft-tree settings
    "ngram": ("ngram", dict(num_draft_tokens=8, max_depth=6, top_k=2)),
    "eagle-chain": ("eagle", dict(num_draft_tokens=6, max_depth=6, top_k=1)),
    "eagle-tree": ("eagle", dict(num_draft_tokens=16, max_depth=6, top_k=4)),
}
# in priority order: greedy tables first, then the sampling rows, then the reference-path and
# bfloat16 rows (same drafter and tree as the first row)
RUNS = ([f"{s}/{d}" for s in SUITES for d in ("eagle-tree", "eagle-chain", "ngram")]
        + [f"{s}/eagle-tree/t{t}" for s in ("gsm8k", "mixed") for t in ("0.7", "1.0")]
        + ["gsm8k/eagle-tree/reference", "gsm8k/eagle-tree/bf16"])


def run_config(name: str, base: dict) -> tuple[str, str, SpecConfig]:
    """``suite/drafter[/tTEMP|/reference|/bf16|/nN|/auto]`` -> (suite file, drafter kind, its
    SpecConfig): sampling at temperature TEMP (seeded), the PyTorch reference path instead of the
    default kernels (Triton on CUDA), bfloat16 activations instead of ``--dtype``, a budget of
    ``N`` draft tokens instead of the drafter's, the default budget policy (``auto``) instead of
    the fixed budget.

    Raises:
        ValueError: an unknown suite, drafter or modifier; pydantic's ValidationError (a
            ValueError) for an out-of-range setting."""
    suite, _, rest = name.partition("/")
    drafter, *extra = rest.split("/")
    if suite not in SUITES or drafter not in DRAFTERS:
        raise ValueError(f"run {name!r}: expected SUITE/DRAFTER[/MODIFIER...] with SUITE in {sorted(SUITES)} "
                         f"and DRAFTER in {sorted(DRAFTERS)}")
    kind, tree = DRAFTERS[drafter]
    engine = dict(budget_policy="fixed")  # the acceptance of this budget, unless /auto
    cfg = dict(base, engine=engine, **tree)
    for e in extra:
        if e == "auto":
            engine.update(budget_policy="auto")
        elif e.startswith("n") and e[1:].isdigit():
            cfg.update(num_draft_tokens=int(e[1:]))
        elif e in ("reference", "triton"):
            engine.update(kernels=e)
        elif e == "bf16":
            cfg.update(dtype="bfloat16")
        elif e.startswith("t") and e[1:].replace(".", "", 1).isdigit():
            cfg.update(temperature=float(e[1:]), seed=0)
        else:
            raise ValueError(f"unknown run modifier {e!r} in {name!r}")
    return SUITES[suite], kind, SpecConfig(**cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True, help="EAGLE drafter directory (specla train-drafter)")
    ap.add_argument("--prompts", required=True, help="folder with the suites' JSONL files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of: {', '.join(RUNS)}")
    ap.add_argument("--time-per-run", type=float, default=60.0, help="seconds before a run starts no new batch")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="float32: greedy outputs comparable token for token")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = add_allow_dirty(ap).parse_args()

    from specla.api import SpecDecoder

    base = dict(max_new_tokens=args.max_new_tokens, dtype=args.dtype, device=args.device)
    try:  # every run checked before the model loads
        plan = {name: run_config(name, base) for name in args.runs.split(",")}
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        ap.error(str(err))
    if args.time_per_run <= 0 or args.batch_size < 1:
        ap.error("--time-per-run must be > 0 and --batch-size >= 1")
    if not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: its directory does not exist")
    if any(kind == "eagle" for _, kind, _ in plan.values()) and not Path(args.drafter).is_dir():
        ap.error(f"--drafter {args.drafter}: not a directory")
    meta = provenance(args.device, args.allow_dirty)
    loaded = SpecDecoder(args.model, config=SpecConfig(**base))  # loaded once for every run
    reports, out = {}, Path(args.out)
    for name, (suite, kind, cfg) in plan.items():
        t0 = time.time()
        report = run_bench(loaded.model, args.drafter if kind == "eagle" else "ngram", Path(args.prompts) / suite,
                           config=cfg, batch_size=args.batch_size, time_limit_s=args.time_per_run,
                           plugin=loaded.plugin.name, tokenizer=loaded.tokenizer,
                           execute_code=True)  # the project's own suites, whose HumanEval rows are scored
        report["wall_s"] = time.time() - t0
        reports[name] = report
        out.write_text(json.dumps({"meta": meta, **reports}, indent=1))
        a = report["categories"]["all"]
        print(json.dumps({"run": name, "prompts": a["prompts"], "mean_accepted": round(a["mean_accepted_tokens"], 3),
                          "speedup": round(a["speedup"], 3), "exact": a["exact_match_rate"],
                          "wall_s": round(report["wall_s"], 1)}), flush=True)
    print(markdown(reports))


def markdown(reports: dict) -> str:
    """One row per run: prompts decoded, mean accepted drafts per step, tokens/s, speedup, exact match."""
    lines = ["| run | prompts | accepted / step | tok/s | AR tok/s | speedup | exact match |",
             "|---|---|---|---|---|---|---|"]
    for name, r in reports.items():
        a = r["categories"]["all"]
        lines.append(f"| {name} | {a['prompts']} of {r['prompts_total']} | {a['mean_accepted_tokens']:.2f} | "
                     f"{a['tokens_per_s']:.0f} | {a['ar_tokens_per_s']:.0f} | {a['speedup']:.2f}x | "
                     f"{a['exact_match_rate']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
