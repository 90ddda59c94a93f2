"""What ``pip install specla`` brings and what runs with it: no FLA and no Triton unless asked for
(FLA installed makes transformers run Qwen3.5's gated delta rule on FLA's Triton kernels, which
fail on a CPU; Triton is 1 GB that CUDA builds of torch already carry), and the demo and the
transformers families run without either."""

import os
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

# a process in which importing FLA or Triton fails, as where neither is installed
BLOCKED = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("fla", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
"""


def _without_fla_and_triton(code: str) -> subprocess.CompletedProcess:
    # PYTHONPATH stays: where specla and its requirements are installed there (a --target install),
    # the process needs it to find them
    path = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    return subprocess.run([sys.executable, "-c", BLOCKED + code], capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", **path})


def test_fla_and_triton_are_extras_not_requirements():
    reqs = [Requirement(r) for r in requires("specla")]
    always = {r.name for r in reqs if r.marker is None}
    fla_extra = {r.name for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "fla"})}
    assert not always & {"flash-linear-attention", "fla-core", "triton"}, always
    assert {"flash-linear-attention", "fla-core", "triton"} <= fla_extra


def test_the_demo_and_a_transformers_family_run_without_fla_and_triton():
    out = _without_fla_and_triton(
        "from specla.apps.demo import run_demo\n"
        "s = run_demo(device='cpu', max_new_tokens=12, echo=lambda line: None, progress=False)\n"
        "print('DEMO', s['plugin'], s['exact_match'])\n"
        "import sys\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('fla', 'triton')))\n")
    assert "DEMO qwen True" in out.stdout and "LOADED []" in out.stdout, out.stdout + out.stderr


def test_an_fla_checkpoint_without_fla_names_the_extra():
    out = _without_fla_and_triton(
        "import specla\n"
        "from specla_fla.plugin import TINY_TARGET\n"
        "try:\n"
        "    specla.SpecDecoder(TINY_TARGET)\n"
        "except specla.UnsupportedModelError as err:\n"
        "    print('ERROR', err)\n")
    assert "ERROR FLA's model classes need flash-linear-attention, which is not installed" in out.stdout, \
        out.stdout + out.stderr
    assert "pip install 'specla[fla]' (from a clone of specla: pip install '.[fla]')" in out.stdout


def test_every_package_folder_of_the_tree_is_installed():
    """pyproject names its packages one by one (the plugins install from plugins/<folder> under
    other names, which setuptools' package discovery cannot give them): every folder with an
    ``__init__.py`` under a package-dir folder must be listed, or a non-editable install lacks it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([name, *init.parent.relative_to(root / folder).parts])
             for name, folder in conf["package-dir"].items() for init in (root / folder).rglob("__init__.py")}
    assert sorted(conf["packages"]) == sorted(found)
