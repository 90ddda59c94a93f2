"""The current-results tables of BENCHMARKS.md, built from the committed raw reports under
``benchmarks/results/`` and git history: a pure function of those files and of the anchor commit
(no GPU, no model; about a second).

    python benchmarks/report.py              # print the tables
    python benchmarks/report.py --write      # rewrite BENCHMARKS.md between its markers

One table per question, one row per configuration, taken from the newest report that measured
it (by date folder, then by the measured commit's place in ``git log``, then by file name):

- trained targets end to end: the ``specla bench`` reports of the trained ``small`` and
  ``small-hybrid`` targets, ``small*-bench-*.json`` (one report, or benchmarks/acceptance.py's
  reports keyed by run name). Configuration: target, drafter, prompt suite, draft shape, batch,
  budget policy, temperature, prefill form, dtype.
- cost models at published shapes: specla's own rows (graph-captured plain decoding, SpecLA
  chain and tree) of ``hybrid-*.json`` (benchmarks/hybrid_study.py) and ``gdn13b-e2e-*.json``
  (benchmarks/e2e.py). Configuration: model shape, embedding scale, batch, row.
- kernels: benchmarks/kernels.py reports (a ``*.json`` with ``bandwidth_GBps``) and
  ``attention-verify-*.jsonl`` (benchmarks/scripts/attention_verify.py). Configuration: kernel
  family, study, case; its batches share one cell.
- baselines: the other rows of those e2e and hybrid reports (FLA, transformers, the snapshot and
  replay commits).
- inside the serving engines: benchmarks/engine_kernels.py reports (``engine-kernels-*.json``):
  specla's verify + commit on an engine's data against the engines' own kernels, per layer of a
  rank. Configuration: op (GDN where a report names none), the layer's shape on one rank (the
  newest report of a shape stands, whichever models it named), workload; its batches share one
  cell (specla first, then each engine contender of the workload, in the report's order).

Each row names the GPU (the report's own field, else the title of its date folder's README.md),
the date (the folder), the commit (the code cell of the folder README's file table, else the
``-<sha>`` that ends the file name, else the report's ``meta.commit``), the code's age (the
commits to ``specla/`` and ``plugins/`` between that commit and the anchor, the HEAD the tables
are generated at), the command (the folder README's, else the report's, else rebuilt from the
report's settings) and the raw file.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "BENCHMARKS.md"
BEGIN, END = "<!-- generated: benchmarks/report.py -->", "<!-- end generated -->"
CODE = ("specla", "plugins")  # the code a row describes: its age counts the commits that changed it
AR_ROWS = ("specla AR (graph)", "AR, specla graph")  # specla's graph-captured plain decoding
OWN_ROWS = (*AR_ROWS, "SpecLA chain", "SpecLA tree")
SUITES = {"gsm8k_test": "gsm8k", "specbench_like": "mixed"}  # small_target_bench.sh's suite names
SHAPES = {(15, 6, 4): "tree", (6, 6, 1): "chain"}  # and its draft shapes
HYBRID_EMBED_SCALE = 32.0  # hybrid_study.py's --embed-scale default, for reports without ``args``
# hybrid_study.py's and e2e.py's --profile and --chain-profile defaults: a setup cell names other ones
DEFAULT_PROFILES = ("benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json:gsm8k/eagle-tree",
                    "benchmarks/results/2026-11-30/run4/acceptance-gsm8k.json:gsm8k/eagle-chain")
PROVENANCE = ["GPU", "date", "commit", "code", "command", "raw"]
QUESTIONS = {  # title, configuration columns, value columns
    "trained": ("Trained targets end to end",
                ["target", "drafter", "suite", "draft", "batch", "settings"],
                ["speedup", "tok/s", "AR tok/s", "accepted / step", "exact", "prompts"]),
    "cost": ("Cost models at published shapes (random weights, oracle acceptance)",
             ["model", "setup", "batch", "row"],
             ["tok/s", "ms / step", "accepted / step", "vs specla AR", "exact"]),
    "kernels": ("Kernels (µs per layer; batch: specla / baseline)",
                ["family", "study", "case"], ["by batch", "baseline"]),
    "baselines": ("Baselines beside specla's graph-captured plain decoding",
                  ["model", "setup", "batch", "row"],
                  ["tok/s", "ms / step", "accepted / step", "vs specla AR", "exact"]),
    "engines": ("Inside the serving engines: verify + commit, µs per layer of a rank (batch: specla / engines)",
                ["op", "shape of a rank", "workload"],
                ["models (TP)", "by batch", "engines", "agree", "running requests a rank fits (specla / engines)"]),
}
# an engine_kernels.py cell's per-rank layer dims, by op (its OPS' dims)
ENGINE_DIMS = {"gdn": ("H", "HV", "K", "V"), "mamba2": ("H", "P", "NG", "NS"), "kda": ("H", "K", "V")}
KERNEL_STUDIES = {  # study: (case field, specla time, baseline time, its label)
    "verify": ("tree", None, "replay_ms", "FLA replay of each root-to-leaf path"),
    "commit": ("accepted", "factor_ms", "replay_ms", "FLA token replay"),
    "fused": ("case", "fused_ms", "separate_ms", "a separate commit, then verify"),
}
ATTENTION = {"sdpa_mask": "attention verify (SDPA, tree mask)", "commit_kv": "attention commit (deepest path)"}


@dataclass
class Source:
    """Where a row comes from (the provenance columns)."""
    date: str
    commit: str | None
    gpu: str
    command: str | None
    raw: str


@dataclass
class Row:
    question: str
    key: tuple  # the configuration: the row's first columns
    values: list[str]
    source: Source


class Git:
    """The history the tables read, against one anchor commit."""

    def __init__(self, root: Path, anchor: str = "HEAD"):
        self.root = root
        self.anchor = self._run("rev-parse", "--short=7", anchor)
        order = self._run("rev-list", "--reverse", "--topo-order", self.anchor).split()
        self.order = {sha[:7]: i for i, sha in enumerate(order)}

    def _run(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True, check=True).stdout.strip()

    def rank(self, commit: str | None) -> int:
        """The commit's place in the anchor's history (-1: unrecorded or not in it)."""
        return self.order.get(commit.split("+")[0][:7], -1) if commit else -1

    @functools.lru_cache(maxsize=None)
    def age(self, commit: str | None) -> str:
        """``current``, ``measured at SHA, N code commits ago``, ``commit not in history`` or
        ``commit not recorded``."""
        if not commit:
            return "commit not recorded"
        sha = commit.split("+")[0]
        if subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=self.root,
                          capture_output=True).returncode:
            return "commit not in history"
        n = int(self._run("rev-list", "--count", f"{sha}..{self.anchor}", "--", *CODE))
        return "current" if n == 0 else f"measured at {sha}, {n} code commits ago"


def expand(name: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]`` (the one brace group the READMEs write)."""
    m = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
    return [m[1] + alt + m[3] for alt in m[2].split(",")] if m else [name]


def folder_notes(folder: Path) -> tuple[str | None, dict[str, dict]]:
    """The GPU the title of ``folder/README.md`` names, and its file table (columns ``file``,
    ``command``, ``code``): file name (relative to the folder) -> the first backticked command
    and the backticked commit the code cell starts with (None where it starts otherwise)."""
    path = folder / "README.md"
    if not path.is_file():
        return None, {}
    lines = path.read_text().splitlines()
    gpu = re.search(r"NVIDIA [A-Z]\w*", lines[0])
    notes, cols = {}, None
    for line in lines:
        if not line.startswith("|"):
            cols = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cols is None:
            cols = {name: i for i, name in enumerate(cells)}
        elif {"file", "command", "code"} <= set(cols) and not set(cells[0]) <= set("-: |"):
            command = re.match(r"`([^`]+)`", cells[cols["command"]])
            commit = re.match(r"`([0-9a-f]{7,40})`", cells[cols["code"]])
            for name in re.findall(r"`([^`]+)`", cells[cols["file"]]):
                for one in expand(name):
                    notes[one] = dict(command=command and command[1], commit=commit and commit[1])
    return (gpu and gpu[0]), notes


def short(commit: str | None) -> str | None:
    """``40-hex[+dirty]`` -> ``7-hex[+dirty]``."""
    if not commit:
        return None
    sha, plus, rest = commit.partition("+")
    return sha[:7] + plus + rest


def source(results: Path, path: Path, meta: dict, command: str | None = None) -> Source:
    """A report's provenance (see the module doc); ``meta``: its ``meta`` block, or the fields
    an older report kept at its top level (``gpu``)."""
    folder = results / path.relative_to(results).parts[0]
    readme_gpu, notes = folder_notes(folder)
    noted = notes.get(str(path.relative_to(folder)), {})
    named = re.search(r"-([0-9a-f]{7})$", path.stem)
    commit = noted.get("commit") or (named and named[1]) or short(meta.get("commit"))
    gpu = meta.get("device") or meta.get("gpu")
    gpu = f"{gpu} (report)" if gpu else f"{readme_gpu} ({folder.name}/README.md)" if readme_gpu else "not recorded"
    command = noted.get("command") or meta.get("command") or command
    if command and command.startswith("benchmarks/"):  # hybrid_study.py kept sys.argv alone
        command = f"python {command}"
    return Source(folder.name, commit, gpu, command, str(path.relative_to(results.parent.parent)))


def run_config(report: dict) -> dict:
    """A report's config with its ``engine`` options beside the other fields, as reports written
    before ``EngineOptions`` hold them."""
    c = report["config"]
    return {**c, **c.get("engine", {})}


def bench_command(target: str, report: dict) -> str | None:
    """The small_target_bench.sh row that makes ``report`` (None for a shape it has no name for)."""
    c = run_config(report)
    shape = SHAPES.get((c["num_draft_tokens"], c["max_depth"], c["top_k"]))
    suite = SUITES.get(Path(report["prompts_file"]).stem)
    if shape is None or suite is None:
        return None
    row = f"{suite}:{shape}:{report['batch_size']}"
    if c["budget_policy"] != "fixed" or c["temperature"]:
        row += f":{c['budget_policy']}" + (f":{c['temperature']:g}" if c["temperature"] else "")
    drafter, prefill = Path(report["drafter"]).name, c.get("prefill") or "auto"
    env = {"PRESET": target != "small" and target, "DRAFTER": drafter != "eagle" and drafter,
           "ENGINE": prefill != "auto" and f"'\"prefill\":\"{prefill}\"'",
           "LIMIT": report["prompts_total"] != 64 and report["prompts_total"],  # the script's defaults
           "MAX_NEW_TOKENS": c["max_new_tokens"] != 128 and c["max_new_tokens"]}
    return " ".join([*(f"{k}={v}" for k, v in env.items() if v), "bash benchmarks/scripts/small_target_bench.sh",
                     "OUT DATA", row])


def trained_rows(results: Path, path: Path, data: dict) -> Iterator[Row]:
    """A ``specla bench`` report, or acceptance.py's reports by run name: one row per report."""
    target = "small-hybrid" if path.name.startswith("small-hybrid-") else "small"
    runs = {None: data} if "categories" in data else {k: v for k, v in data.items() if k != "meta"}
    for run, r in runs.items():
        c, a = run_config(r), r["categories"]["all"]
        kind = "chain" if c["top_k"] == 1 else "tree"
        draft = f"{kind} N{c['num_draft_tokens']} d{c['max_depth']}" + (f" k{c['top_k']}" if c["top_k"] > 1 else "")
        prefill = c.get("prefill") or "auto"  # reports older than the option ran the default
        settings = [c["budget_policy"], *[f"T {c['temperature']:g}"] * (c["temperature"] > 0),
                    *[f"prefill {prefill}"] * (prefill != "auto"), *[c["dtype"]] * (c["dtype"] != "bfloat16")]
        key = (target, Path(r["drafter"]).name, Path(r["prompts_file"]).stem, draft, r["batch_size"], ", ".join(settings))
        speedup = a.get("speedup", a["tokens_per_s"] / a["ar_tokens_per_s"])
        prompts = f"{r['prompts_decoded']} of {r['prompts_total']}" + " (time limit)" * bool(r["stopped_early"])
        values = [f"{speedup:.2f}x", f"{a['tokens_per_s']:.0f}", f"{a['ar_tokens_per_s']:.0f}",
                  f"{a['mean_accepted_tokens']:.2f}", f"{a['exact_match_rate']:.3f}", prompts]
        if run is None:
            src = source(results, path, data.get("meta", {}), bench_command(target, r))
        else:  # acceptance.py's reports: each run named its GPU before the file had a meta block
            src = source(results, path, data.get("meta", {"gpu": r.get("gpu")}),
                         "python benchmarks/acceptance.py --model OUT/small --drafter OUT/eagle --prompts DATA/prompts "
                         f"--batch-size {r['batch_size']} --runs {run}")
            src.raw += f" ({run})"
        yield Row("trained", key, values, src)


def _num(row: dict, field: str, spec: str) -> str:
    return "" if row.get(field) is None else format(row[field], spec)


def model_setup(args: dict) -> str:
    """The setup cell of an e2e.py or hybrid_study.py report's rows: the embedding scale, then the
    drafter whose cost is paid and the replayed profiles where they are not the defaults."""
    cell = [f"embed x{args['embed_scale']:g}"]
    if args.get("drafter", "eagle") != "eagle":
        cell.append(f"{args['drafter']} drafter")
    profiles = (args.get("profile", DEFAULT_PROFILES[0]), args.get("chain_profile", DEFAULT_PROFILES[1]))
    if profiles != DEFAULT_PROFILES:
        cell.append(f"profile {profiles[0]}" if profiles[0] == profiles[1]
                    else f"tree profile {profiles[0]}, chain profile {profiles[1]}")
    return ", ".join(cell)


def model_rows(results: Path, path: Path, data: dict) -> Iterator[Row]:
    """An e2e.py or hybrid_study.py report: specla's own rows (cost models) and the others
    (baselines), each with its ratio to specla's graph AR row of the same report and batch."""
    meta, rows = data["meta"], data["rows"]
    args = meta.get("args")
    if args is None:  # a hybrid report from before ``args`` was kept: its command line
        scale = re.search(r"--embed-scale[ =](\S+)", meta["command"])
        args = dict(embed_scale=float(scale[1]) if scale else HYBRID_EMBED_SCALE)
    ar = {r["B"]: r["tokens_per_s"] for r in rows if r["row"] in AR_ROWS}
    command = None
    if "studies" in args:  # e2e.py before it kept its command line
        command = (f"python benchmarks/e2e.py --out OUT --studies {args['studies']} --batches "
                   f"{','.join(map(str, args['batches']))}" + " --core-rows" * bool(args.get("core_rows")))
    src = source(results, path, meta, command)
    for r in rows:
        model = r["model"] if "model" in r else f"gdn-1.3b ({args['layers']} layers)"
        ratio = f"{r['tokens_per_s'] / ar[r['B']]:.2f}x" if r["B"] in ar else "no AR row"
        values = [_num(r, "tokens_per_s", ".1f"), _num(r, "ms_per_step", ".2f"), _num(r, "accepted_per_step", ".2f"),
                  ratio, _num(r, "exact", ".3f")]
        yield Row("cost" if r["row"] in OWN_ROWS else "baselines",
                  (model, model_setup(args), r["B"], r["row"]), values, src)


def kernel_rows(results: Path, path: Path, data: dict) -> Iterator[Row]:
    """A kernels.py report: per study and case, every batch in one cell."""
    src = source(results, path, data.get("meta", {"gpu": data.get("gpu")}))  # the GPU: older reports' top level
    family = data.get("plugin", "gdn")
    for study, (case_field, ours, theirs, label) in KERNEL_STUDIES.items():
        cases: dict[str, list[str]] = {}
        for r in data.get(study, []):
            if ours is None:  # verify: the fastest kernel, named
                name = min((n for n in ("serial", "parallel", "hybrid") if f"{n}_ms" in r), key=lambda n: r[f"{n}_ms"])
                cell = f"{r['batch']}: {r[f'{name}_ms'] * 1e3:.1f} {name} / {r[theirs] * 1e3:.1f}"
            else:
                cell = f"{r['batch']}: {r[ours] * 1e3:.1f} / {r[theirs] * 1e3:.1f}"
            case = f"{r[case_field]} accepted" if case_field == "accepted" else r[case_field]
            cases.setdefault(case, []).append(cell)
        for case, cells in cases.items():
            yield Row("kernels", (family, study, case), ["; ".join(cells), label], src)


def attention_rows(results: Path, path: Path, lines: list[dict]) -> Iterator[Row]:
    """attention_verify.py's JSON lines (a first ``meta`` line where the run recorded one)."""
    meta = lines[0]["meta"] if lines and "meta" in lines[0] else {}
    src = source(results, path, meta)
    cases: dict[tuple, list[str]] = {}
    for r in (x for x in lines if "meta" not in x):
        case = f"{r['shape']}, {r['nodes']} nodes, {r['filled']} of {r['capacity']} cached"
        cases.setdefault((ATTENTION.get(r["variant"], r["variant"]), case), []).append(f"{r['B']}: {r['ms'] * 1e3:.1f}")
    for (study, case), cells in cases.items():
        yield Row("kernels", ("attention", study, case), ["; ".join(cells), "none"], src)


def engine_rows(results: Path, path: Path, data: dict) -> Iterator[Row]:
    """A benchmarks/engine_kernels.py report: per op, model set and workload, every batch in one cell
    (specla's time, then each engine contender's), whether every cell's outputs and committed
    states agreed with SGLang's, and per model the running requests one rank fits in the
    report's memory budget."""
    src = source(results, path, data["meta"])
    cases: dict[tuple, list[dict]] = {}
    def case(entry: dict) -> tuple[str, str, str]:
        """A cell's (or an unfit cell's) op, per-rank shape and workload; reports from before the
        op axis timed GDN alone."""
        op = entry.get("op", "gdn")
        shape = " ".join(f"{d}{entry[d]}" for d in ENGINE_DIMS[op] if d in entry) or entry["models"]
        return op, shape, entry["workload"]

    for c in data["cells"]:
        cases.setdefault(case(c), []).append(c)
    fits: dict[tuple, dict] = {}
    for m in data.get("memory", []):
        fits.setdefault((m["model"], m["tp"], m["workload"]), {})[m["contender"]] = m["requests_in_budget"]
    unfit: dict[tuple, set[int]] = {}  # cells that ran out of GPU memory
    for u in data.get("unfit", []):
        unfit.setdefault(case(u), set()).add(u["batch"])
    batches = {c["batch"] for c in data["cells"]} | {b for bs in unfit.values() for b in bs}
    for (op, shape, workload), cells in cases.items():
        models = cells[0]["models"]
        others = [k for k in cells[0]["us"] if k != "specla"]
        parts = {c["batch"]: f"{c['batch']}: " + " / ".join(f"{c['us'][k]:.1f}" for k in ["specla", *others])
                 for c in cells}
        for b in unfit.get((op, shape, workload), ()):
            parts[b] = f"{b}: out of GPU memory"
        if data.get("complete") is False:  # a run cut short: the batches it timed elsewhere, not here
            for b in batches - set(parts):
                parts[b] = f"{b}: not run (the run stopped)"
        by_batch = "; ".join(parts[b] for b in sorted(parts))
        requests = []
        for model, tp in re.findall(r"([\w.-]+) \((\d+)\)", models):
            fit = fits.get((model, int(tp), workload), {})
            requests.append(f"{model} " + " / ".join(str(fit[k]) for k in ["specla", *others] if k in fit))
        agree = "yes" if all(c["agree"] for c in cells) else "NO"
        yield Row("engines", (op, shape, workload), [models, by_batch, ", ".join(others), agree,
                                                     f"{data['args']['budget_gib']:g} GiB: " + "; ".join(requests)], src)


def all_rows(results: Path) -> Iterator[Row]:
    """Every row of every report the tables read (see the module doc for the file names)."""
    for path in sorted(results.rglob("*.json")):
        data = json.loads(path.read_text())
        if re.fullmatch(r"small.*-bench-.*\.json", path.name):
            yield from trained_rows(results, path, data)
        elif re.fullmatch(r"(hybrid|gdn13b-e2e)-.*\.json", path.name):
            yield from model_rows(results, path, data)
        elif isinstance(data, dict) and "bandwidth_GBps" in data:
            yield from kernel_rows(results, path, data)
        elif re.fullmatch(r"engine-kernels-.*\.json", path.name):
            yield from engine_rows(results, path, data)
    for path in sorted(results.rglob("attention-verify-*.jsonl")):
        yield from attention_rows(results, path, [json.loads(x) for x in path.read_text().splitlines() if x.strip()])


def newest(rows: Iterator[Row], git) -> list[Row]:
    """Per question and configuration, the row of the newest report."""
    best: dict[tuple, Row] = {}
    for row in rows:
        k = (row.question, row.key)
        rank = (row.source.date, git.rank(row.source.commit), row.source.raw)
        if k not in best or rank > (best[k].source.date, git.rank(best[k].source.commit), best[k].source.raw):
            best[k] = row
    return list(best.values())


def _natural(value):
    """Numbers inside a name compare by value (``T=8`` before ``T=16``)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", value)] if isinstance(value, str) else value


def _order(row: Row) -> tuple:
    """Configuration order; in a model's rows specla's AR row, chain and tree first."""
    *head, last = row.key
    return (*map(_natural, head), OWN_ROWS.index(last) if last in OWN_ROWS else len(OWN_ROWS), _natural(last))


def cell(text) -> str:
    return str(text).replace("|", "\\|")


def table(question: str, rows: list[Row], git) -> str:
    title, config, values = QUESTIONS[question]
    head = [*config, *values, *PROVENANCE]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted((r for r in rows if r.question == question), key=_order):
        s = r.source
        prov = [s.gpu, s.date, s.commit or "not recorded", git.age(s.commit),
                f"`{s.command}`" if s.command else "not recorded", f"`{s.raw}`"]
        lines.append("| " + " | ".join(cell(x) for x in [*r.key, *r.values, *prov]) + " |")
    return "\n".join(lines)


def tables(results: Path, git) -> str:
    """The generated part of BENCHMARKS.md (between its markers, markers excluded)."""
    rows = newest(all_rows(results), git)
    note = (f"Made by `python benchmarks/report.py --write` from the raw reports; code ages count the commits "
            f"to `specla/` and `plugins/` up to `{git.anchor}`. Not to be edited by hand "
            "(`tests/apps/test_benchmarks_report.py` compares it with the script's output).")
    return "\n\n".join([note, *(table(q, rows, git) for q in QUESTIONS)])


def anchor_of(doc: str) -> str:
    """The anchor commit named in the generated part of ``doc``.

    Raises:
        ValueError: ``doc`` has no generated part naming its anchor."""
    m = re.search(re.escape(BEGIN) + r"\n.*? up to `([0-9a-f]{7,40})`", doc, re.S)
    if not m:
        raise ValueError(f"no generated part with its anchor commit between {BEGIN!r} and {END!r}")
    return m[1]


def replace_generated(doc: str, generated: str) -> str:
    """``doc`` with the text between its markers replaced.

    Raises:
        ValueError: the markers are missing or out of order."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        raise ValueError(f"BENCHMARKS.md needs the markers {BEGIN!r} and then {END!r}")
    return doc[: start + len(BEGIN)] + "\n" + generated + "\n" + doc[end:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's generated part")
    ap.add_argument("--anchor", default="HEAD", help="the commit code ages count to (default HEAD)")
    args = ap.parse_args()
    generated = tables(RESULTS, Git(ROOT, args.anchor))
    if args.write:
        try:
            DOC.write_text(replace_generated(DOC.read_text(), generated))
        except ValueError as err:
            ap.error(str(err))
    else:
        print(generated)


if __name__ == "__main__":
    main()
