"""Speedup of speculative decoding over plain decoding as a function of the mean accepted length,
read off the committed raw reports: a cost model on random weights, not a speed claim.

    python benchmarks/cost_model.py [--results benchmarks/results] [--out benchmarks/results/cost-model]
                                    [--no-plot]

A speculative step emits ``L + 1`` tokens per sequence (``L`` accepted drafts and the bonus
token) in ``t_spec`` ms; plain decoding emits one token per sequence in ``t_ar`` ms, so
``speedup(L) = (L + 1) * t_ar / t_spec``. Both step times come from one raw report, at one
batch size:

- ``hybrid-*.json`` (``benchmarks/hybrid_study.py``): published hybrid shapes; rows ``specla AR
  (graph)``, ``transformers generate`` (tokens/s only, its prefill included), ``SpecLA chain``
  and ``SpecLA tree`` with ``ms_per_step`` (median decode time over the run's steps);
- ``gdn13b-e2e-*.json`` (``benchmarks/e2e.py``, its ``baselines`` rows): the GDN-1.3B shape;
  ``AR, specla graph``, ``AR, FLA model in a CUDA graph``, ``AR, transformers generate (eager)``,
  ``SpecLA chain`` and ``SpecLA tree``;
- ``policy-probe-*.jsonl`` (``benchmarks/scripts/policy_probe.py``): the ``small`` shape; rows
  ``ar``, ``chain`` and ``tree`` with fixed budgets, whose step time is the last timed call's
  decode time (``wall_s - prefill_s``) over its steps. These files carry no meta: the commit is
  the file name's last part, the date its folder's name.

``t_ar`` is the fastest plain-decoding row of the report at that batch; ``t_spec`` includes the
drafting (a random EAGLE head drafted the row's own budget every step: chain N 6, tree N 15, both
depth 6, from ``e2e.CHAIN`` / ``e2e.TREE``). ``L`` runs over 1..6; a cell past the budget's depth
is ``beyond depth`` (no step accepts more drafts than its depth). A batch size that a shape's
reports did not measure is ``not measured``: nothing is carried across batch sizes.

Per shape, batch size and kind the newest report measuring it is used: the latest date, then
the latest commit time of the commit it names (``git log``); a speculative row whose outputs
differed from plain decoding's (``exact`` below 1) is no measurement of this decoder and is left
out. Writes ``OUT/cost-model.json`` (every cell) and ``OUT/cost-model.png`` (one panel per
shape) and prints the markdown table of ``docs/cost-model.md``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import CHAIN, TREE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32, 64)
LENGTHS = range(1, 7)
BUDGETS = {"chain": CHAIN, "tree": TREE}
SOURCES = ("hybrid-*.json", "gdn13b-e2e-*.json", "policy-probe-*.jsonl")
ROWS = {  # each writer's row names: plain decoding or a speculative kind
    "specla AR (graph)": "plain", "transformers generate": "plain", "SpecLA chain": "chain", "SpecLA tree": "tree",
    "AR, specla graph": "plain", "AR, FLA model in a CUDA graph": "plain", "AR, transformers generate (eager)": "plain",
    "ar": "plain", "chain": "chain", "tree": "tree",
}


def speedup(L: int, t_ar: float, t_spec: float) -> float:
    """``(L + 1) * t_ar / t_spec``: the tokens per ms of speculative steps emitting ``L + 1``
    tokens per sequence over those of plain decoding's one-token steps."""
    return (L + 1) * t_ar / t_spec


@functools.cache
def commit_time(commit: str) -> int | None:
    """Unix time of ``commit`` (a suffix such as ``+dirty`` dropped) in this repository, or
    ``None`` where git does not know it."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", commit.split("+")[0], "--"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(out.stdout) if out.stdout.strip() else None


def _row(shape: str, r: dict, ms: float, accepted: float | None, measured: float | None) -> dict:
    return dict(shape=shape, batch=r.get("B", r.get("batch")), name=r["row"], kind=ROWS[r["row"]], ms=ms,
                accepted=accepted, exact=r.get("exact"), measured=measured)


def read_report(path: Path) -> dict:
    """One raw report as ``path``, ``commit``, ``date``, ``device`` and its rows (``shape``,
    ``batch``, ``name``, ``kind``, ``ms`` per step, ``accepted`` drafts per step, ``exact``);
    rows of other studies or decoders are left out.

    Raises:
        ValueError: a file none of :data:`SOURCES` names.
    """
    if path.suffix == ".jsonl" and path.name.startswith("policy-probe-"):
        raw = [r for r in map(json.loads, path.read_text().splitlines()) if r["row"] in ROWS]
        decode = {(r["batch"], r["row"]): r["last_call"]["wall_s"] - r["last_call"]["prefill_s"] for r in raw}
        # every row decodes the same prompts to 128 new tokens (no stop at EOS): the decode-time
        # ratio to the plain row of its batch is the measured speedup
        rows = [_row("small", r, decode[r["batch"], r["row"]] / r["last_call"]["steps"] * 1e3,
                     r["last_call"]["mean_accepted_tokens"],
                     decode[r["batch"], "ar"] / decode[r["batch"], r["row"]] if (r["batch"], "ar") in decode else None)
                for r in raw]
        return dict(path=path, commit=path.stem.rsplit("-", 1)[1], date=path.parent.name, device=None, rows=rows)
    data = json.loads(path.read_text())
    meta = data["meta"]
    if path.name.startswith("hybrid-"):
        raw = [(r["model"], r) for r in data["rows"]]
    elif path.name.startswith("gdn13b-e2e-"):
        layers = meta["args"]["layers"]
        shape = "gdn-1.3b" if layers == 24 else f"gdn-1.3b-{layers}-layers"
        raw = [(shape, r) for r in data["rows"] if r["study"] == "baselines"]
    else:
        raise ValueError(f"{path}: not a raw report of the cost model (expected one of {', '.join(SOURCES)})")
    rows = [_row(shape, r, r["ms_per_step"] if "ms_per_step" in r else r["B"] / r["tokens_per_s"] * 1e3,
                 r.get("accepted_per_step"), r.get("vs_best_ar")) for shape, r in raw if r["row"] in ROWS]
    return dict(path=path, commit=meta["commit"], date=meta["date"], device=meta.get("device", meta.get("gpu")),
                rows=rows)


def reports(results: Path) -> list[dict]:
    """Every raw report of :data:`SOURCES` in the dated folders under ``results``."""
    return [read_report(p) for pattern in SOURCES for p in sorted(results.glob(f"*/{pattern}"))]


def _newest(cands: list[dict], what: str) -> dict:
    """The candidate of the latest date, then of the latest commit time.

    Raises:
        ValueError: two candidates of the latest date whose order git cannot tell.
    """
    day = max(c["report"]["date"][:10] for c in cands)
    same = [c for c in cands if c["report"]["date"][:10] == day]
    times = [commit_time(c["report"]["commit"]) for c in same]
    if len(same) > 1 and (None in times or times.count(max(times)) > 1):
        names = ", ".join(f"{c['report']['path'].name} (commit {c['report']['commit']})" for c in same)
        raise ValueError(f"{what}: {names} measured it on {day} and their commits' order is unknown")
    return same[times.index(max(times))] if len(same) > 1 else same[0]


def select(reps: list[dict]) -> dict[tuple[str, int, str], dict]:
    """Per ``(shape, batch, kind)`` the newest report's measurement: ``report``, the plain rows
    of that batch (fastest first) and the speculative ``row``. Rows with ``exact`` below 1 are
    left out, and a batch without a plain row gives no measurement."""
    cands: dict[tuple[str, int, str], list[dict]] = {}
    for rep in reps:
        for r in rep["rows"]:
            plain = sorted((p for p in rep["rows"] if p["kind"] == "plain" and (p["shape"], p["batch"]) ==
                            (r["shape"], r["batch"])), key=lambda p: p["ms"])
            if r["kind"] != "plain" and plain and r["exact"] in (None, 1.0):
                cands.setdefault((r["shape"], r["batch"], r["kind"]), []).append(dict(report=rep, plain=plain, row=r))
    return {k: _newest(c, f"{k[0]} at batch {k[1]} ({k[2]})") for k, c in cands.items()}


def _source(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def cells(chosen: dict[tuple[str, int, str], dict]) -> list[dict]:
    """Every cell: each shape, batch (:data:`BATCHES` and any other measured), kind and ``L`` of
    :data:`LENGTHS`, with ``status`` ``measured``, ``not measured`` or ``beyond depth``."""
    out = []
    for shape in sorted({k[0] for k in chosen}):
        for B in sorted(set(BATCHES) | {k[1] for k in chosen if k[0] == shape}):
            for kind, budget in BUDGETS.items():
                m = chosen.get((shape, B, kind))
                base = dict(shape=shape, batch=B, kind=kind, num_draft_tokens=budget["num_draft_tokens"],
                            max_depth=budget["max_depth"])
                for L in LENGTHS:
                    if m is None:
                        out.append(dict(base, L=L, status="not measured", speedup=None))
                        continue
                    rep, t_ar, t_spec = m["report"], round(m["plain"][0]["ms"], 4), round(m["row"]["ms"], 4)
                    beyond = L > budget["max_depth"]
                    out.append(dict(base, L=L, status="beyond depth" if beyond else "measured",
                                    speedup=None if beyond else round(speedup(L, t_ar, t_spec), 4),
                                    t_ar_ms=t_ar, t_spec_ms=t_spec, ar_row=m["plain"][0]["name"],
                                    measured_at_L=round(m["row"]["accepted"], 4),
                                    measured_speedup=m["row"]["measured"] and round(m["row"]["measured"], 4),
                                    slower_plain_ms={p["name"]: round(p["ms"], 4) for p in m["plain"][1:]},
                                    source=_source(rep["path"]), commit=rep["commit"], date=rep["date"],
                                    device=rep["device"]))
    return out


def _x(s: float) -> str:
    """A speedup as the table writes it: bold where speculation loses."""
    return f"**{s:.2f}x**" if s < 1 else f"{s:.2f}x"


def table(cs: list[dict]) -> str:
    """The markdown of ``docs/cost-model.md``: per shape its sources, its plain-decoding rows and
    a table of batch x kind against ``L``."""
    out = []
    head = "| batch | kind | t_ar ms | t_spec ms | measured (L: speedup) | " + " | ".join(f"L={L}" for L in LENGTHS) \
        + " |"
    for shape in dict.fromkeys(c["shape"] for c in cs):
        mine = [c for c in cs if c["shape"] == shape]
        measured = [c for c in mine if c["status"] != "not measured" and c["L"] == LENGTHS[0]]
        srcs = {}
        for c in measured:
            srcs.setdefault((c["source"], c["commit"], c["date"], c["device"]), []).append(c["batch"])
        out += [f"### {shape}", ""]
        for (src, commit, date, device), bs in srcs.items():
            sha, plus, rest = commit.partition("+")
            short = sha[:7] + plus + rest  # the hash as git abbreviates it, "+dirty" kept
            out.append(f"- `{src}` (commit `{short}`, {date}, {device or 'device not recorded'}): "
                       f"batch {', '.join(map(str, dict.fromkeys(bs)))}")
        plain = {c["batch"]: [(c["ar_row"], c["t_ar_ms"]), *c["slower_plain_ms"].items()] for c in measured}
        out.append("- plain decoding, ms per step, fastest (t_ar) first: " + "; ".join(
            f"batch {B}: " + ", ".join(f"{n} {ms:.3f}" for n, ms in rows) for B, rows in plain.items()))
        out += ["", head, "|---" * (5 + len(LENGTHS)) + "|"]
        blank = " |" * (2 + len(LENGTHS))
        for B in dict.fromkeys(c["batch"] for c in mine):
            kinds = [c for c in mine if c["batch"] == B and c["L"] == LENGTHS[0]]
            if all(c["status"] == "not measured" for c in kinds):  # one row says it for the batch
                kinds = [dict(kinds[0], kind=", ".join(c["kind"] for c in kinds))]
            for k in kinds:
                if k["status"] == "not measured":
                    out.append(f"| {B} | {k['kind']} | not measured |{blank}")
                    continue
                seen = "not recorded" if k["measured_speedup"] is None else _x(k["measured_speedup"])
                Ls = [c["status"] if c["speedup"] is None else _x(c["speedup"])
                      for c in mine if (c["batch"], c["kind"]) == (B, k["kind"])]
                out.append(f"| {B} | {k['kind']} | {k['t_ar_ms']:.3f} | {k['t_spec_ms']:.3f} | "
                           f"{k['measured_at_L']:.2f}: {seen} | " + " | ".join(Ls) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def plot(cs: list[dict], path: Path) -> None:
    """One panel per shape: speedup against ``L``, a line per batch (colour) and kind (chain
    solid, tree dashed), the 1.0x line drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(c["shape"] for c in cs))
    cols = 5
    fig, axes = plt.subplots(-(-len(shapes) // cols), cols, figsize=(3.2 * cols, 3.0 * -(-len(shapes) // cols)),
                             sharex=True, squeeze=False)
    colour = {B: f"C{i}" for i, B in enumerate(sorted({c["batch"] for c in cs}))}
    top = max(c["speedup"] for c in cs if c["speedup"] is not None)
    for ax, shape in zip(axes.flat, shapes):
        for (B, kind) in dict.fromkeys((c["batch"], c["kind"]) for c in cs if c["shape"] == shape):
            pts = [(c["L"], c["speedup"]) for c in cs if (c["shape"], c["batch"], c["kind"]) == (shape, B, kind)
                   and c["speedup"] is not None]
            if pts:
                ax.plot(*zip(*pts), "-o" if kind == "chain" else "--s", color=colour[B], ms=3, lw=1.2,
                        label=f"batch {B}, {kind}")
        ax.axhspan(0, 1, color="0.92", zorder=0)
        ax.axhline(1.0, color="k", lw=0.8)
        missing = [str(B) for B in dict.fromkeys(c["batch"] for c in cs if c["shape"] == shape)
                   if all(c["status"] == "not measured" for c in cs if (c["shape"], c["batch"]) == (shape, B))]
        title = shape + (f"\nbatch {', '.join(missing)}: not measured" if missing else "\n")
        ax.set(title=title, ylim=(0, top * 1.05), xticks=list(LENGTHS))
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(shapes):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("L: accepted drafts per step")
    for ax in axes[:, 0]:
        ax.set_ylabel("speedup over plain decoding")
    lines = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    labels = sorted(lines, key=lambda lab: (int(lab.split()[1].rstrip(",")), lab))
    fig.legend([lines[lab] for lab in labels], labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("Cost model on random weights, one GPU: (L + 1) t_ar / t_spec from the raw reports "
                 "(grey: speculation loses)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90, pil_kwargs=dict(optimize=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cost-model")
    ap.add_argument("--no-plot", action="store_true", help="write the JSON and print the table only")
    a = ap.parse_args(argv)
    if not a.no_plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("the plot needs matplotlib: pip install matplotlib (or pass --no-plot)")
    cs = cells(select(reports(a.results)))
    a.out.mkdir(parents=True, exist_ok=True)
    doc = dict(model="speedup(L) = (L + 1) * t_ar / t_spec, from the step times of the raw reports (random "
               "weights, oracle drafter with a random EAGLE head's cost, one GPU, prefill not included)",
               cells=cs)
    (a.out / "cost-model.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not a.no_plot:
        plot(cs, a.out / "cost-model.png")
    print(table(cs), end="")


if __name__ == "__main__":
    main()
