"""Code says what a rule decides, not what was measured: no comment or docstring of the library,
the plugins, the examples or the benchmark scripts cites a timing, a GPU model, a speedup figure,
a measuring commit or a run's date. The figures behind a threshold live in docs/tuning.md or
BENCHMARKS.md, which the code cites."""

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMING_LOG = re.compile(
    r"\b\d+(\.\d+)? ?(ns|us|µs|ms)\b"  # a time: "139 us", "6.7 ms"
    r"|\b\d+(\.\d+)? s\b"  # "0.28 s"
    r"|\b[AHLV]100\b|\b[HB]200\b"  # a GPU model
    r"|\d(\.\d+)?x\b.{0,40}\b(faster|slower|speedup)|\b(faster|slower|speedup).{0,40}\d(\.\d+)?x\b"
    r"|\bcommit `*[0-9a-f]{7,40}\b"  # where something was measured: "(commit ``7884c7f``)"
    r"|\b20\d\d-\d\d-\d\d\b",  # when: "2026-12-03"
    re.I)


def prose(source: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of every comment and every line of every docstring of a module."""
    lines = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            first = body[0].lineno
            lines += [(first + i, text) for i, text in enumerate(ast.get_source_segment(source, body[0]).splitlines())]
    return sorted(lines)


def timing_logs(source: str) -> list[tuple[int, str]]:
    """The comment and docstring lines of ``source`` that read like a timing log."""
    return [(n, text.strip()) for n, text in prose(source) if TIMING_LOG.search(text)]


def test_no_comment_or_docstring_cites_timings_or_gpus():
    if not (ROOT / ".git").exists():
        pytest.skip("lists the tracked files with git")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "specla/*.py", "plugins/*.py", "examples/*.py",
                            "benchmarks/*.py"], capture_output=True, text=True, check=True).stdout.split()
    hits = [f"{f}:{n}: {text}" for f in files if not f.startswith("benchmarks/results/")
            for n, text in timing_logs((ROOT / f).read_text())]
    assert not hits, "move these figures to docs/tuning.md or BENCHMARKS.md and cite it:\n" + "\n".join(hits)


def test_the_scan_finds_timings_in_comments_and_docstrings_only():
    planted = '''"""Module doc."""
X = 8  # 139 vs 208 us at batch 64


def f():
    """The rule, measured on an H200 (commit ``7884c7f``): 2.2x faster, 0.28 s, 2026-12-03."""
    return "6.7 ms"  # a string the code prints is not prose


def g():
    """A tile of 64 columns spills; docs/tuning.md has the figures; 16 nodes x 4 heads."""
'''
    assert timing_logs(planted) == [
        (2, "# 139 vs 208 us at batch 64"),
        (6, '"""The rule, measured on an H200 (commit ``7884c7f``): 2.2x faster, 0.28 s, 2026-12-03."""'),
    ]
    for line in ["# 139 us", "# 6.7 ms", "# 0.28 s", "# on an H100", "# on one H200", "# 3.4x to 4.2x faster",
                 "# a speedup of 2.01x", "# commit `4c84958`", "# 2026-12-04, one GPU", "# 0.4 µs slower"]:
        assert timing_logs(line + "\n"), line
