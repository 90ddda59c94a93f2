"""The worked example of docs/plugins.md (a GDN + attention hybrid plugin that subclasses no
adapter) installed as a third-party package: a folder on ``sys.path`` with the package and a
``dist-info`` naming its entry point in the ``specla.plugins`` group, found by
``importlib.metadata`` in a fresh process and run through the packaged conformance suite."""

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()


def example_source() -> str:
    """The one code block of docs/plugins.md that is ``myhybrid_specla/plugin.py``."""
    blocks = re.findall(r"```python\n(# myhybrid_specla/plugin\.py.*?)```", DOC, re.S)
    assert len(blocks) == 1, f"docs/plugins.md holds {len(blocks)} myhybrid_specla/plugin.py blocks"
    return blocks[0]


def install(root: Path) -> None:
    """The package ``myhybrid_specla`` and its ``dist-info`` (entry point ``myhybrid``) in ``root``."""
    package = root / "myhybrid_specla"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text(example_source())
    info = root / "myhybrid_specla-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myhybrid-specla\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specla.plugins]\nmyhybrid = myhybrid_specla.plugin\n")


def test_the_documented_plugin_installs_and_passes_the_conformance_suite(tmp_path):
    install(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = ("import sys\nfrom specla.registry import plugin_infos\nfrom specla.testing import check_plugin\n"
            "info = {i.name: i for i in plugin_infos()}['myhybrid']\n"
            "print('origin:', info.origin, 'builtin:', info.builtin)\n"
            "sys.exit(0 if check_plugin('myhybrid') else 1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3000, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "origin: myhybrid-specla 0.1 builtin: False" in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"^\d+ passed", proc.stdout.splitlines()[-1]), proc.stdout[-2000:]


def test_the_docs_give_the_worked_examples_length_in_lines():
    lines = len(example_source().splitlines())
    assert re.findall(r"(?:file of|in) (\d+) lines", DOC) == [str(lines), str(lines)]
