"""The documents cite only files that exist: every repository path in BENCHMARKS.md, CHANGELOG.md,
README.md and docs/*.md (in backticks or as a link target) names a file of the tree, a raw result
under benchmarks/results/, or, written ``COMMIT:PATH``, a file of git history."""

import glob
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = sorted(p for p in (ROOT / "benchmarks" / "results").glob("*") if p.is_dir())
BASES = [ROOT, *RESULTS, *(d for r in RESULTS for d in sorted(r.glob("run*")))]  # where run-relative names live
PATH = re.compile(r"^([0-9a-f]{7,40}:)?(benchmarks|specla|plugins|tests|docs|examples|run\d)/")
OUTPUTS = {"--out", ">", "tee"}  # the word after these is a file a command writes
WRITTEN_BY_USERS = {"tests/test_conformance_myarch.py"}  # a plugin author's file, not ours


def expand(token: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]`` (shell braces)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in expand(token[: m.start()] + alt + token[m.end():])]


def cited(text: str) -> list[str]:
    """Repository paths in backticks (words of commands too, except what they write) and links."""
    out = []
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        words = span.split()
        out += [w for prev, w in zip([""] + words, words) if prev not in OUTPUTS]
    for block in re.findall(r"```.*?```", text, flags=re.S):
        for line in block.splitlines():
            words = line.split()
            out += [w.strip('"') for prev, w in zip([""] + words, words) if prev not in OUTPUTS]
    out += [m for m in re.findall(r"\]\(([^)#\s]+)", text) if not m.startswith("http")]
    keep = []
    for token in out:
        token = token.split("=")[-1].rstrip(".,;:)")
        if PATH.search(token) and not any(c in token for c in "$<") and "OUT" not in token and "DIR" not in token:
            keep.append(token)
    return keep


def exists(token: str) -> bool:
    m = re.match(r"^([0-9a-f]{7,40}):(.+)$", token)
    if m:
        return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", token], capture_output=True).returncode == 0
    if token in WRITTEN_BY_USERS:
        return True
    bases = BASES if token.startswith("run") else [ROOT]
    return all(any(glob.glob(str(b / t)) for b in bases) for t in expand(token.split(":")[0]))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_path_exists(doc):
    if not (ROOT / ".git").exists():
        pytest.skip("COMMIT:PATH references need the git history")
    tokens = cited(doc.read_text())
    missing = sorted({t for t in tokens if not exists(t)})
    assert not missing, f"{doc.name} cites paths that do not exist: {missing}"


def test_the_checker_sees_a_missing_path():
    assert not exists("benchmarks/results/no-such-run/x.json")
    assert not exists("0000000:benchmarks/e2e.py")
    assert exists("benchmarks/e2e.py") and exists("specla/{api,config}.py")
    assert cited("see `benchmarks/e2e.py --out benchmarks/new.json` and [x](docs/usage.md)") == \
        ["benchmarks/e2e.py", "docs/usage.md"]


def test_docs_and_code_do_not_narrate_work_periods():
    """Runs are named by date, commit and command; history lives in git log. No tracked document,
    script or source file (raw results aside) names the work periods that produced them."""
    if not (ROOT / ".git").exists():
        pytest.skip("lists the tracked files with git")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.md", "*.py", "*.sh", "*.toml"],
                           capture_output=True, text=True, check=True).stdout.split()
    word = re.compile(r"\bsess" + r"ions?\b", re.I)  # split so that this file does not match itself
    hits = [f"{f}:{i}" for f in files if not f.startswith("benchmarks/results/")
            for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if word.search(line)]
    assert not hits, hits


def test_docs_install_from_a_clone_not_from_pypi():
    """specla is not on PyPI: the user's documents install it from a clone (``pip install .``)."""
    pypi = re.compile(r"pip install [\"']?specla\b")
    hits = [f"{doc.name}:{i}" for doc in DOCS if doc.name == "README.md" or doc.parent.name == "docs"
            for i, line in enumerate(doc.read_text().splitlines(), 1) if pypi.search(line)]
    assert not hits, f"install specla from a clone, it is not on PyPI: {hits}"
