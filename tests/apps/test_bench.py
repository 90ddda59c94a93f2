"""specla bench: task checks and the side-by-side report (tiny target, bundled prompts)."""

import datetime
import json
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import specla.apps.bench
from specla import SpecConfig
from specla.apps.bench import (device_name, format_table, gsm8k_answer, humaneval_passes, library_versions,
                               load_prompts, run_bench, source_commit)
from specla.apps.cli import main
from specla_fla.plugin import TINY_TARGET

TINY = TINY_TARGET
DATA = str(resources.files("specla.apps").joinpath("data/demo_prompts.jsonl"))
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text, expected",
    [("She makes 9 * 2 = $18.\n#### 18", "18"), (" 1,234 apples\nthen 5", "5"), ("no number", None),
     (" The answer is 7.\nQuestion: 12", "7"), ("#### -3.5", "-3.5"), ("costs 1,234.", "1234"),
     (" She has 16 - 3 - 4 = 9 eggs\nso 18 dollars", "18")],
)
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


def test_humaneval_execution():
    row = [r for r in load_prompts(DATA) if r["category"] == "humaneval"][0]
    assert humaneval_passes(row, row["canonical_solution"]) is True
    assert humaneval_passes(row, "    return None\n") is False
    assert humaneval_passes(row, "    while True:\n        pass\n", timeout_s=2) is False


def test_bench_report_is_side_by_side_and_exact():
    cfg = SpecConfig(max_new_tokens=24, dtype="float32", top_k=2, engine=dict(budget_policy="fixed"))
    report = run_bench(TINY, "ngram", DATA, config=cfg, limit=6, batch_size=2, execute_code=True)
    cats = report["categories"]
    assert set(cats) == {"gsm8k", "humaneval", "all"}
    for c in cats.values():
        assert c["exact_match_rate"] == 1.0
        assert c["tokens_per_s"] > 0 and c["speedup"] == pytest.approx(c["tokens_per_s"] / c["ar_tokens_per_s"])
    assert cats["all"]["prompts"] == 6
    for task in ("gsm8k_accuracy", "humaneval_pass_at_1"):
        cat = cats["gsm8k" if task.startswith("gsm8k") else "humaneval"][task]
        assert cat["n"] == 3 and cat["speculative"] == cat["autoregressive"]  # exact outputs, same scores
    assert "gsm8k_accuracy" in format_table(report)
    spent = report["speculative_calls"]  # 3 timed calls of 2 prompts, fixed budget, eager steps
    steps = sum(sum(c["accepted_histogram"]) for n, c in cats.items() if n != "all")
    assert steps / 2 <= spent["steps"] <= steps and spent["plain_steps"] == spent["budget_switches"] == 0
    assert 0 < spent["prefill_s"] < spent["wall_s"]
    plain = report["plain_calls"]  # the same prompts, one token per step
    assert plain["steps"] >= spent["steps"] and 0 < plain["prefill_s"] < plain["wall_s"]
    assert spent["prefill"] == plain["prefill"] == "chain"  # the form that ran (the default on a CPU)


def test_bench_cli(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "specla.apps.cli", "bench", "--model", str(TINY), "--prompts", DATA,
                           "--limit", "2", "--max-new-tokens", "8", "--device", "cpu", "--out", str(out),
                           "--config", '{"dtype": "float32"}', "--allow-dirty"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert list(report)[0] == "meta"
    assert "speedup" in proc.stdout and report["categories"]["all"]["prompts"] == 2
    assert report["dtype"] == report["config"]["dtype"] == "float32"  # the run's dtype, by name


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "specla.apps.cli", *args], capture_output=True, text=True, timeout=600)


def test_bench_cli_user_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    noprompt = tmp_path / "noprompt.jsonl"
    noprompt.write_text('{"id": "a", "text": "hi"}\n')
    cases = [
        (["--prompts", str(empty)], "holds no prompts"),
        (["--prompts", str(noprompt)], "row has no non-empty string 'prompt'"),
        (["--prompts", DATA, "--limit", "0"], "must be >= 1"),
        (["--prompts", DATA, "--config", "[1, 2]"], "--config must be a JSON object"),
        (["--prompts", DATA, "--config", "{top_k: 2}"], "--config: not valid JSON (Expecting property name"),
        (["--prompts", DATA, "--batch-size", "0"], "must be >= 1"),
    ]
    for extra, message in cases:
        out = _cli("bench", "--model", str(TINY), *extra)
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 2 and message in last and "Traceback" not in out.stderr, (extra, out.stderr[-500:])


def test_batches_do_not_mix_categories(tmp_path):
    rows = [json.loads(x) for x in open(DATA)]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(json.dumps(r) for r in (rows[0], rows[3], rows[1])) + "\n")
    cfg = SpecConfig(max_new_tokens=12, dtype="float32")
    together = run_bench(TINY, "ngram", mixed, config=cfg, batch_size=4)["categories"]
    alone = run_bench(TINY, "ngram", mixed, config=cfg, batch_size=1)["categories"]
    for cat in ("gsm8k", "humaneval"):
        assert sum(together[cat]["accepted_histogram"]) > 0
    assert together["humaneval"]["accepted_histogram"] == alone["humaneval"]["accepted_histogram"]


def test_the_warm_up_covers_cache_sizes_graph_batches_and_ragged_prefill(tmp_path, monkeypatch):
    """The untimed warm-up decodes the suite's longest prompt (in tokens) at every batch size the
    run measures, largest first, so a drafter cache sized for prompt + max_new_tokens, and the
    CUDA graphs recorded on it, are not resized or recorded inside the timed run (the EAGLE
    drafter's capacity after the first warm-up call is the largest the run reaches); then at every
    smaller power-of-two graph batch a batch's tail gathers into; then each size's first batch
    as it is timed (its ragged prefill)."""
    import specla.apps.bench

    rows = [{"prompt": "Q: 1 + 1?", "category": "gsm8k"},
            {"prompt": "Q: " + "count the apples and the pears again, " * 30, "category": "gsm8k"},
            {"prompt": "Q: 2 + 2?", "category": "gsm8k"}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    calls = []

    def spy(method):  # the speculative decoder's warm-up and timed calls, with its cache capacity
        def called(self, prompts):
            out = method(self, prompts)
            if self.drafter is not None and hasattr(self.drafter, "capacity"):
                calls.append((prompts, self.drafter.capacity))
            return out
        return called

    monkeypatch.setattr(specla.apps.bench.SpecDecoder, "generate", spy(specla.apps.bench.SpecDecoder.generate))
    monkeypatch.setattr(specla.apps.bench.SpecDecoder, "warm_up", spy(specla.apps.bench.SpecDecoder.warm_up))
    cfg = SpecConfig(max_new_tokens=8, dtype="float32", num_draft_tokens=4, max_depth=3)
    long, p = rows[1]["prompt"], [r["prompt"] for r in rows]
    run_bench(TINY, str(TINY.parent / "tiny-eagle"), path, config=cfg, batch_size=1)
    assert [c[0] for c in calls] == [[long], [p[0]], [p[0]], [p[1]], [p[2]]]  # warm-up, then timed
    assert calls[0][1] == max(c for _, c in calls) > 256  # the long prompt needs a larger cache
    calls.clear()  # batches of 2 and 1: both sizes warmed, the full one first, then their first batches
    run_bench(TINY, str(TINY.parent / "tiny-eagle"), path, config=cfg, batch_size=2)
    assert [c[0] for c in calls] == [[long] * 2, [long], p[:2], [p[2]], p[:2], [p[2]]]
    calls.clear()  # one batch of 3 (graph batch 4): the graph batches 2 and 1 of its tail warmed too
    run_bench(TINY, str(TINY.parent / "tiny-eagle"), path, config=cfg, batch_size=4)
    assert [c[0] for c in calls] == [[long] * 3, [long] * 2, [long], p, p]


def test_limit_takes_categories_round_robin():
    rows = load_prompts(DATA)
    picked = load_prompts(DATA, limit=3)
    first = {c: [r for r in rows if r["category"] == c] for c in ("gsm8k", "humaneval")}
    assert [r["id"] for r in picked] == [first["gsm8k"][0]["id"], first["humaneval"][0]["id"], first["gsm8k"][1]["id"]]


def test_time_limit_stops_after_the_first_batch_and_says_so():
    cfg = SpecConfig(max_new_tokens=8, dtype="float32")
    report = run_bench(TINY, "ngram", DATA, config=cfg, limit=4, batch_size=1, time_limit_s=1e-9)
    assert report["prompts_decoded"] == 1 and report["prompts_total"] == 4 and report["stopped_early"] is True
    assert report["categories"]["all"]["prompts"] == 1
    assert "time limit: 1 of 4 prompts decoded" in format_table(report)
    assert "sampling" not in format_table(report)  # greedy: exact is meant to be 1
    report["config"]["temperature"] = 0.7
    assert "sampling: 'exact' is not expected to be 1" in format_table(report)
    with pytest.raises(ValueError, match="time_limit_s must be positive"):
        run_bench(TINY, "ngram", DATA, config=cfg, limit=1, time_limit_s=0)


@pytest.mark.parametrize("row, match", [
    ({"prompt": "x", "category": None}, "'category' must be a non-empty string"),
    ({"prompt": "x", "category": ["a"]}, "'category' must be a non-empty string"),
    ({"prompt": "x", "category": "all"}, "other than 'all'"),
    ({"prompt": "x", "answer": 42}, "'answer' must be a string"),
    ({"prompt": ""}, "non-empty string 'prompt'"),
])
def test_every_row_is_checked_before_decoding(tmp_path, row, match):
    """A bad row anywhere in the file is reported with its line before any prompt is decoded."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine", "category": "a"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"p.jsonl:2: .*{match}"):
        load_prompts(f)
    plain = tmp_path / "q.jsonl"
    plain.write_text('{"prompt": "y"}\n')
    assert load_prompts(plain)[0]["category"] == "uncategorized"


@pytest.mark.parametrize("args, match", [
    (["--time-limit", "nan"], "positive finite number of seconds"),
    (["--time-limit", "0"], "positive finite number of seconds"),
    (["--limit", "abc"], "not an integer: 'abc'"),
    (["--out", "/nonexistent-dir/r.json"], "does not exist"),
    (["--out", "/tmp"], "--out /tmp: is a directory"),
    (["--out", "/proc/r.json"], "--out /proc/r.json: not writable"),
])
def test_bench_flags_are_checked_before_decoding(args, match):
    proc = _cli("bench", "--model", str(TINY), "--prompts", DATA, "--device", "cpu", *args)
    assert proc.returncode == 2 and match in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("prompts, problem", [("/nonexistent.jsonl", "no such file"), ("/tmp", "is a directory"),
                                              ("/dev/zero", "not a regular file")])
def test_a_prompts_file_that_cannot_be_read_is_named(prompts, problem, capsys):
    if not Path(prompts).exists() and problem != "no such file":
        pytest.skip(f"no {prompts} here")
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--model", str(TINY), "--prompts", prompts, "--device", "cpu"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"specla: error: --prompts {prompts}: {problem}\n"


def test_a_report_that_cannot_be_written_names_its_path(monkeypatch, capsys):
    """/dev/full opens for writing, so only the write after the run fails: the error names --out."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    monkeypatch.setattr(specla.apps.bench, "run_bench", lambda *a, **k: {"categories": {}})
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--model", str(TINY), "--prompts", DATA, "--device", "cpu", "--out", "/dev/full",
              "--allow-dirty"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "specla: error: --out /dev/full: the report could not be written (No space left on device); the table "
        "above is the run's only record")


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git repository with one committed file (no ``$SPECLA_COMMIT``)."""
    monkeypatch.delenv("SPECLA_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.py").write_text("x = 1\n")
    _git(repo, "add", "f.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "one")
    return repo


def _dirty(repo):
    return (f"the checkout {repo} has uncommitted changes (f.py): commit them, or pass --allow-dirty to record "
            "the commit as <sha>+dirty")


def test_the_commit_is_refused_for_a_dirty_checkout_unless_allowed(checkout, monkeypatch, tmp_path):
    """Untracked files are not measured code; a changed tracked file is refused, or with
    ``allow_dirty`` recorded as ``<sha>+dirty``; ``$SPECLA_COMMIT`` (a copy of the tree without
    git) is taken as given; no checkout, or no git: None."""
    head = _git(checkout, "rev-parse", "HEAD")
    (checkout / "notes.txt").write_text("untracked")
    assert source_commit(checkout) == head
    (checkout / "f.py").write_text("x = 2\n")
    with pytest.raises(ValueError, match=f"^{re.escape(_dirty(checkout))}$"):
        source_commit(checkout)
    assert source_commit(checkout, allow_dirty=True) == head + "+dirty"
    monkeypatch.setenv("SPECLA_COMMIT", "abc1234")
    assert source_commit(checkout) == "abc1234"
    monkeypatch.delenv("SPECLA_COMMIT")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert source_commit(None) is None and source_commit(plain) is None


def test_only_specla_s_own_checkout_has_a_commit(checkout, monkeypatch):
    """An editable install (the package is the checkout's ``specla/``) is a checkout; a copy
    installed into a virtual environment inside some repository is not."""
    if (ROOT / ".git").exists():
        assert specla.apps.bench.checkout_root() == ROOT
    installed = checkout / ".venv" / "site-packages" / "specla"
    installed.mkdir(parents=True)
    monkeypatch.setattr(specla.apps.bench, "__file__", str(installed / "apps" / "bench.py"))
    assert specla.apps.bench.checkout_root() is None


def test_bench_refuses_a_dirty_checkout_before_decoding(checkout, monkeypatch, capsys, tmp_path):
    (checkout / "f.py").write_text("x = 2\n")
    monkeypatch.setattr(specla.apps.bench, "checkout_root", lambda: checkout)
    monkeypatch.setattr(specla.apps.bench, "run_bench", lambda *a, **k: pytest.fail("decoded a dirty checkout"))
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--model", str(TINY), "--prompts", DATA, "--device", "cpu", "--out", str(out)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"specla: error: {_dirty(checkout)}\n"
    assert not out.exists()


def test_bench_report_meta_names_commit_device_versions_date_command(checkout, monkeypatch, capsys, tmp_path):
    (checkout / "f.py").write_text("x = 2\n")
    monkeypatch.setattr(specla.apps.bench, "checkout_root", lambda: checkout)
    monkeypatch.setattr(specla.apps.bench, "run_bench", lambda *a, **k: {"categories": {}})
    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(TINY), "--prompts", DATA, "--device", "cpu", "--out", str(out), "--allow-dirty"]
    assert main(argv) == 0
    meta = json.loads(out.read_text())["meta"]
    assert list(meta) == ["commit", "device", "versions", "date", "command"]
    assert meta["commit"] == _git(checkout, "rev-parse", "HEAD") + "+dirty"
    assert meta["device"] == device_name("cpu")
    assert list(meta["versions"]) == ["torch", "triton", "transformers", "flash-linear-attention", "fla-core",
                                      "specla"]
    assert meta["versions"] == library_versions()
    assert meta["command"] == "specla " + " ".join(argv)
    assert "note" not in capsys.readouterr().err  # a commit was recorded
    date = datetime.datetime.fromisoformat(meta["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - date) < datetime.timedelta(minutes=5)


def test_bench_from_an_installed_copy_runs_and_says_it_records_no_commit(monkeypatch, capsys, tmp_path):
    """``pip install .`` has no checkout to check: the run is not refused, and one note on
    stderr says the report has no commit and nothing was checked."""
    monkeypatch.delenv("SPECLA_COMMIT", raising=False)
    monkeypatch.setattr(specla.apps.bench, "checkout_root", lambda: None)
    monkeypatch.setattr(specla.apps.bench, "run_bench", lambda *a, **k: {"categories": {}})
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(TINY), "--prompts", DATA, "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["commit"] is None
    assert capsys.readouterr().err == (
        "specla: note: specla is not run from its git checkout (an editable install or the source tree), so the "
        "report records no commit (meta.commit is null; meta.versions names specla's version) and uncommitted "
        "changes are not checked\n")


def test_a_prompts_files_code_runs_only_when_asked_and_without_the_environment(tmp_path, monkeypatch):
    """A HumanEval row's ``prompt`` and ``test`` are code chosen by whoever wrote the file: without
    ``execute_code`` nothing of it runs (the report counts the row as not run, the table says how
    to run it); with it, it runs in a subprocess that sees none of the caller's environment."""
    marker = tmp_path / "ran.txt"
    test = (f"'''\nimport os, pathlib\npathlib.Path({str(marker)!r}).write_text(repr(os.environ.get('SECRET')))\n"
            "def check(fn):\n    pass\n")
    row = {"id": "evil", "category": "humaneval", "prompt": "def f():\n    '''", "test": test, "entry_point": "f"}
    path = tmp_path / "evil.jsonl"
    path.write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("SECRET", "token-123")
    cfg = SpecConfig(max_new_tokens=4, dtype="float32")
    report = run_bench(TINY, "ngram", path, config=cfg)
    assert not marker.exists() and report["code_tests_not_run"] == 1
    assert "humaneval_pass_at_1" not in report["categories"]["humaneval"]
    assert format_table(report).endswith("1 rows hold code tests (HumanEval): not run; --execute-code runs the "
                                         "prompts file's code and the model's in a subprocess (no sandbox)")
    report = run_bench(TINY, "ngram", path, config=cfg, execute_code=True)
    assert marker.read_text() == "None" and report["code_tests_not_run"] == 0
    assert report["categories"]["humaneval"]["humaneval_pass_at_1"]["n"] == 1
