"""``specla bench``: a prompt suite through speculative and autoregressive decoding, side by side.

For every prompt both runs use the same target, dtype, device and batch composition; the
autoregressive run is the same engine with no drafts (``num_draft_tokens = 0``), so the ratio
isolates speculation. Reports per category: the acceptance-length histogram and mean, tokens/s of
both runs and their ratio, the exact-match rate, and task checks that must agree between the runs:
GSM8K final-answer accuracy (rows with an ``answer`` ending in ``#### N``) and HumanEval pass@1
(rows with ``test`` and ``entry_point``). The HumanEval check runs the row's own ``prompt`` and
``test`` code with the model's completion, so whoever wrote the prompts file chooses what runs: it
runs only when asked (``execute_code=True``, ``specla bench --execute-code``), in an isolated
Python subprocess with an empty environment, a temporary directory and a timeout (no sandbox).

:func:`provenance` is what every raw report records about the run that made it (``specla bench``'s
``meta`` block, and the scripts under ``benchmarks/`` through ``benchmarks/provenance.py``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from itertools import zip_longest
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..api import SpecDecoder
from ..config import SpecConfig
from ..cuda.graph_step import batch_bucket
from ..step import step_depth
from .jsonl import read_jsonl

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# the libraries a run's figures depend on, in the order ``meta.versions`` lists them
PROVENANCE_LIBRARIES = ("torch", "triton", "transformers", "flash-linear-attention", "fla-core", "specla")


def library_versions() -> dict[str, str]:
    """The installed version of each of :data:`PROVENANCE_LIBRARIES` (``not installed`` for a
    missing one)."""
    out = {}
    for name in PROVENANCE_LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def checkout_root() -> Path | None:
    """The git checkout of specla this package runs from (an editable install or a run from the
    tree: the package is the checkout's ``specla/`` folder), else None (an installed copy, even
    one inside some other repository's virtual environment)."""
    package = Path(__file__).resolve().parents[1]  # specla/ holds apps/bench.py
    try:
        top = Path(_git(package, "rev-parse", "--show-toplevel").strip()).resolve()
    except (OSError, subprocess.CalledProcessError):
        return None
    return top if top / "specla" == package else None


def source_commit(root: Path | None, *, allow_dirty: bool = False) -> str | None:
    """The commit a run measures: ``$SPECLA_COMMIT`` when set (a copy of the tree without git,
    taken as given), else the ``HEAD`` of the checkout at ``root`` (40 hex digits, ``+dirty``
    when tracked files have uncommitted changes); None without a root or without git (an
    installed package: ``meta.versions["specla"]`` names it).

    Raises:
        ValueError: naming the checkout and the changed files: tracked files differ from
            ``HEAD`` and ``allow_dirty`` is false (the figures would belong to no commit).
    """
    if os.environ.get("SPECLA_COMMIT"):
        return os.environ["SPECLA_COMMIT"]
    if root is None:
        return None
    try:
        head = _git(root, "rev-parse", "HEAD").strip()
        changed = _git(root, "status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    if changed and not allow_dirty:
        names = ", ".join(line[3:] for line in changed[:5]) + (", ..." if len(changed) > 5 else "")
        raise ValueError(f"the checkout {root} has uncommitted changes ({names}): commit them, or pass "
                         "--allow-dirty to record the commit as <sha>+dirty")
    return head + ("+dirty" if changed else "")


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU's (``platform.processor()`` or the machine
    type) with its core count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def provenance(device: str, *, root: Path | None, allow_dirty: bool = False, command: str | None = None) -> dict:
    """The ``meta`` block of a raw report: ``commit`` (:func:`source_commit` of ``root``),
    ``device`` (:func:`device_name`), ``versions`` (:func:`library_versions`), ``date`` (UTC,
    ISO 8601, seconds) and ``command`` (default: this process's command line).

    Raises:
        ValueError: see :func:`source_commit` (checked first, before anything else is read).
    """
    commit = source_commit(root, allow_dirty=allow_dirty)
    return dict(commit=commit, device=device_name(device), versions=library_versions(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command or shlex.join([Path(sys.executable).name, *sys.argv]))


def gsm8k_answer(text: str) -> str | None:
    """The final number of a GSM8K-style answer: after ``####`` when present, else the last
    number before the model starts a new ``Question:`` (completions tend to run on)."""
    text = text.split("Question:", 1)[0]
    if "####" in text:
        m = NUMBER.search(text.split("####", 1)[1])
        return m.group().replace(",", "").rstrip(".") if m else None
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def humaneval_passes(row: dict, completion: str, timeout_s: float = 10.0) -> bool:
    """Run ``prompt + completion + test + check(entry_point)`` in a fresh, isolated Python
    subprocess (``-I``: no user site or ``PYTHON*`` variables) with an empty environment (the
    caller's secrets stay out), in a temporary directory, for at most ``timeout_s`` seconds."""
    program = f"{row['prompt']}{completion}\n\n{row['test']}\n\ncheck({row['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "candidate.py"
        path.write_text(program)
        try:
            proc = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp, capture_output=True, timeout=timeout_s,
                                  env={})
        except subprocess.TimeoutExpired:
            return False
    return proc.returncode == 0


def _by_category(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by ``category``, categories in order of first appearance."""
    groups = defaultdict(list)
    for row in rows:
        groups[row["category"]].append(row)
    return list(groups.values())


def _interleave(groups: list[list]) -> list:
    """One item of each group in turn (the first of every group, then the second...)."""
    return [item for turn in zip_longest(*groups) for item in turn if item is not None]


def load_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows of a prompt-suite JSONL (each with ``id``, ``category``, ``prompt``); with ``limit``,
    the first ``limit`` rows taken round-robin over the categories (in file order within each).

    Every row is checked before anything is decoded: rows without a category get
    ``uncategorized``; ``all`` is reserved for the report's total.

    Raises:
        ValueError: naming the file and line: a row that is not a JSON object, has no non-empty
            string ``prompt``, a category that is not a non-empty string or is ``all``, an
            ``answer`` that is not a string; also no rows, ``limit < 1``.
    """
    rows = []
    for i, row in read_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{i}: row has no non-empty string 'prompt'")
        row.setdefault("category", "uncategorized")
        if not isinstance(row["category"], str) or not row["category"] or row["category"] == "all":
            raise ValueError(f"{path}:{i}: 'category' must be a non-empty string other than 'all' "
                             f"(the report's total), got {row['category']!r}")
        if "answer" in row and not isinstance(row["answer"], str):
            raise ValueError(f"{path}:{i}: 'answer' must be a string, got {type(row['answer']).__name__}")
        rows.append(row)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if limit is not None:  # round-robin over categories, so a short run still covers every one
        rows = _interleave(_by_category(rows))[:limit]
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


def run_bench(model, drafter, prompts_file, *, config: SpecConfig, limit: int | None = None,
              batch_size: int = 1, plugin: str | None = None, time_limit_s: float | None = None,
              tokenizer=None, execute_code: bool = False) -> dict:
    """Decode a suite speculatively and autoregressively; return the report (see module doc;
    ``speculative_calls`` sums the timed speculative calls' :class:`~specla.engine.RunStats`
    steps, budget-policy figures, recorded graphs, prefill and wall seconds, and the prefill forms
    they ran; ``plain_calls`` the plain-decoding calls' steps, recorded graphs, prefill and wall
    seconds and prefill forms).

    Args:
        model: checkpoint directory or loaded model; drafter: ``ngram`` or a drafter directory.
        tokenizer: tokenizer or its directory (default: the checkpoint directory's own).
        config: the speculative configuration (the baseline uses it with no drafts).
        batch_size: prompts decoded together (both runs use the same batches, which never mix
            categories; batches of different categories alternate).
        execute_code: run the HumanEval rows' code (theirs and the model's: see the module doc);
            without it those rows are decoded and timed, and the report counts them in
            ``code_tests_not_run`` instead of scoring them.
        time_limit_s: start no new batch after this many seconds (wall clock, both runs counted;
            the first batch always runs);
            the report says how many prompts were decoded (``prompts_decoded``) and whether the
            limit cut the suite short (``stopped_early``).
    Raises:
        ValueError: see :func:`load_prompts`; ``batch_size < 1``; ``time_limit_s <= 0``.

    With ``execute_code``, HumanEval rows execute the prompts file's code and model-written code
    in a subprocess of this machine (no sandbox beyond isolation, an empty environment, a
    temporary directory and a timeout).
    """
    rows = load_prompts(prompts_file, limit)
    spec = SpecDecoder(model, plugin, drafter=drafter, config=config, tokenizer=tokenizer)
    ar = SpecDecoder(spec.model, spec.plugin.name, config=config.model_copy(update={"num_draft_tokens": 0}),
                     tokenizer=spec.tokenizer)
    per = defaultdict(lambda: {"prompts": 0, "exact": 0, "spec_tokens": 0, "ar_tokens": 0, "spec_s": 0.0, "ar_s": 0.0,
                               "hist": [0] * (step_depth(config) + 1),
                               "gsm8k": [0, 0, 0], "humaneval": [0, 0, 0]})
    samples, not_run = [], 0
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    # batches never mix categories, so every per-category figure is measured, not apportioned
    # alternate categories so that a time-limited run still covers every one
    batches = _interleave([[same[i : i + batch_size] for i in range(0, len(same), batch_size)]
                           for same in _by_category(rows)])
    if time_limit_s is not None and time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    # warm-up outside the timing, as a server warms up before it serves: Triton compiles a kernel
    # for each new shape class on first use (seconds each) and a CUDA graph is recorded per graph
    # batch and candidate budget, which would otherwise land in the timed batches. First the
    # suite's longest prompt at every batch size measured, largest first, so that the caches sized
    # for prompt + max_new_tokens (and the graphs recorded on them) are sized once, not again
    # mid-run; then every smaller graph batch (a batch's tail gathers its live rows into them as
    # rows finish); then each size's first batch as timed (ragged prompts: the prefill's own shape
    # classes)
    longest = max((r["prompt"] for r in rows), key=lambda p: len(spec.encode([p])[0]))
    sizes = sorted({len(b) for b in batches}, reverse=True)
    graph_batches = {1 << i for i in range(batch_bucket(sizes[0]).bit_length())}
    tails = sorted(graph_batches - {batch_bucket(size) for size in sizes}, reverse=True)
    firsts = [next(b for b in batches if len(b) == size) for size in sizes]
    for prompts in [[longest] * size for size in sizes + tails] + [[r["prompt"] for r in b] for b in firsts]:
        spec.warm_up(prompts)  # every candidate budget's graphs too, under the adaptive policy
        ar.generate(prompts)
    started, done = time.perf_counter(), 0
    # where the speculative calls' time went, summed over the timed calls (RunStats fields)
    spent = dict.fromkeys(("steps", "plain_steps", "chain_steps", "budget_switches", "switch_s", "graphs_recorded",
                           "prefill_s", "wall_s"), 0)
    plain = dict.fromkeys(("steps", "graphs_recorded", "prefill_s", "wall_s"), 0)
    forms = (set(), set())  # the prefill forms the timed calls ran (RunStats.prefill)
    for batch in tqdm(batches, desc="bench", unit="batch", disable=None):
        if done and time_limit_s is not None and time.perf_counter() - started > time_limit_s:
            break
        done += len(batch)
        t = time.perf_counter()
        s = spec.generate([r["prompt"] for r in batch])
        spec_s = time.perf_counter() - t
        t = time.perf_counter()
        a = ar.generate([r["prompt"] for r in batch])
        ar_s = time.perf_counter() - t
        for k in spent:
            spent[k] += getattr(s.stats, k)
        for k in plain:
            plain[k] += getattr(a.stats, k)
        forms[0].add(s.stats.prefill)
        forms[1].add(a.stats.prefill)
        for j, row in enumerate(batch):
            c = per[row["category"]]
            share = len(s.outputs[j]) / max(s.stats.generated_tokens, 1)  # batch time split by tokens
            c["prompts"] += 1
            c["exact"] += s.outputs[j] == a.outputs[j]
            c["spec_tokens"] += len(s.outputs[j])
            c["ar_tokens"] += len(a.outputs[j])
            c["spec_s"] += spec_s * share
            c["ar_s"] += ar_s * len(a.outputs[j]) / max(a.stats.generated_tokens, 1)
            if "answer" in row and "####" in row["answer"]:
                gold = gsm8k_answer(row["answer"])
                c["gsm8k"][0] += 1
                c["gsm8k"][1] += gsm8k_answer(s.texts[j]) == gold
                c["gsm8k"][2] += gsm8k_answer(a.texts[j]) == gold
            if "test" in row and "entry_point" in row and not execute_code:
                not_run += 1
            elif "test" in row and "entry_point" in row:
                c["humaneval"][0] += 1
                c["humaneval"][1] += humaneval_passes(row, s.texts[j])
                c["humaneval"][2] += humaneval_passes(row, a.texts[j])
            if len(samples) < 3:
                samples.append({"id": row.get("id"), "completion": s.texts[j]})
        c = per[batch[0]["category"]]
        c["hist"] = [h + n for h, n in zip(c["hist"], s.stats.accepted_histogram)]
    cats = {}
    for name, c in sorted(per.items()) + [("all", _total(per))]:
        steps = sum(c["hist"])
        cats[name] = {
            "prompts": c["prompts"],
            "exact_match_rate": c["exact"] / c["prompts"],
            "accepted_histogram": list(c["hist"]),
            "mean_accepted_tokens": sum(k * h for k, h in enumerate(c["hist"])) / max(steps, 1),
            "tokens_per_s": c["spec_tokens"] / c["spec_s"],
            "ar_tokens_per_s": c["ar_tokens"] / c["ar_s"],
            "speedup": (c["spec_tokens"] / c["spec_s"]) / (c["ar_tokens"] / c["ar_s"]),
        }
        for task, (n, ok_spec, ok_ar) in (("gsm8k_accuracy", c["gsm8k"]), ("humaneval_pass_at_1", c["humaneval"])):
            if n:
                cats[name][task] = {"speculative": ok_spec / n, "autoregressive": ok_ar / n, "n": n}
    return {"prompts_file": str(prompts_file), "drafter": str(drafter), "batch_size": batch_size,
            "prompts_total": len(rows), "prompts_decoded": done, "stopped_early": done < len(rows),
            "code_tests_not_run": not_run,
            "config": config.model_dump(mode="json"), "device": str(spec.adapter.device),
            "dtype": str(spec.adapter.dtype).removeprefix("torch."), "categories": cats,
            "speculative_calls": {**spent, "prefill": ",".join(sorted(forms[0]))},
            "plain_calls": {**plain, "prefill": ",".join(sorted(forms[1]))}, "samples": samples}


def _total(per: dict) -> dict:
    tot = {"prompts": 0, "exact": 0, "spec_tokens": 0, "ar_tokens": 0, "spec_s": 0.0, "ar_s": 0.0,
           "hist": None, "gsm8k": [0, 0, 0], "humaneval": [0, 0, 0]}
    for c in per.values():
        for k in ("prompts", "exact", "spec_tokens", "ar_tokens", "spec_s", "ar_s"):
            tot[k] += c[k]
        tot["hist"] = c["hist"] if tot["hist"] is None else [a + b for a, b in zip(tot["hist"], c["hist"])]
        for k in ("gsm8k", "humaneval"):
            tot[k] = [a + b for a, b in zip(tot[k], c[k])]
    return tot


def format_table(report: dict) -> str:
    """The summary table printed by ``specla bench``."""
    head = f"{'category':<22}{'n':>5}{'acc/step':>10}{'tok/s':>10}{'AR tok/s':>10}{'speedup':>9}{'exact':>8}  tasks"
    lines = [head, "-" * len(head)]
    for name, c in report["categories"].items():
        tasks = "; ".join(f"{k} {v['speculative']:.3f} (AR {v['autoregressive']:.3f})"
                          for k, v in c.items() if isinstance(v, dict))
        lines.append(f"{name:<22}{c['prompts']:>5}{c['mean_accepted_tokens']:>10.3f}{c['tokens_per_s']:>10.1f}"
                     f"{c['ar_tokens_per_s']:>10.1f}{c['speedup']:>9.3f}{c['exact_match_rate']:>8.3f}  {tasks}")
    if report.get("stopped_early"):
        lines.append(f"time limit: {report['prompts_decoded']} of {report['prompts_total']} prompts decoded")
    if report.get("code_tests_not_run"):
        lines.append(f"{report['code_tests_not_run']} rows hold code tests (HumanEval): not run; --execute-code runs "
                     "the prompts file's code and the model's in a subprocess (no sandbox)")
    if report.get("config", {}).get("temperature", 0) > 0:
        lines.append("sampling: 'exact' is not expected to be 1 (both runs draw their own samples; "
                     "the output distribution is what stays lossless)")
    return "\n".join(lines)
