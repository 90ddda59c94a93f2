"""The layers of the installed distribution, read from the sources' syntax trees (no module is
imported): the library (``specla``, its op tier ``specla.mixers.<op>`` included) imports no model
plugin and no plugin imports another, so that a plugin reaches an op only through the library;
the apps (``specla.apps``: the command line, demo, bench, drafter training) sit on top, imported
by other apps, the tests and the benchmarks only, never by the library, a plugin or an example;
every third-party module the library and the plugins import is the standard library's or a
declared requirement; a requirement of an extra (FLA, Triton, the test tools) loads only where it
is used; and every import of the tree's packages, lazy ones and ``kernels("...")`` handles
included (they run only when a function is called or a kernel launched), names one of its modules
and a name that module binds.

The plugin packages and the folders they install from are pyproject's ``package-dir`` mapping."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # import name -> folder
PLUGINS = {name for name, folder in PACKAGE_DIRS.items() if folder.startswith("plugins/")}
# distributions whose import name is not their own name with "-" as "_"
IMPORT_NAMES = {"flash-linear-attention": "fla", "fla-core": "fla"}
# imported but not declared: present wherever the declared requirement in the value is, which
# requires it (checked below against that distribution's own metadata)
BROUGHT_BY = {"huggingface_hub": "transformers"}


@dataclass(frozen=True)
class Import:
    """One import of ``module`` (absolute) at ``where`` (``path:line``), ``lazy`` when it runs
    only when a function is called (inside a function, under ``if TYPE_CHECKING``, or the
    module name of a ``kernels("...")`` handle, then ``handle``). ``from X import a`` is one
    import of ``X`` with ``X.a`` among its ``submodules`` (``a`` may be one)."""

    module: str
    where: str
    lazy: bool
    handle: bool = False
    submodules: tuple[str, ...] = ()


def module_name(path: Path) -> str:
    """The dotted name a file of the tree installs as (``plugins/fla/plugin.py`` ->
    ``specla_fla.plugin``; a package's ``__init__.py`` -> the package)."""
    rel = path.relative_to(ROOT)
    for name, folder in PACKAGE_DIRS.items():
        if rel.parent == Path(folder) or Path(folder) in rel.parents:
            parts = [name, *rel.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(f"{rel} is not in any package of pyproject's package-dir")


def imports(source: str, name: str, is_package: bool, where: str) -> list[Import]:
    """Every import of a module's source, relative ones made absolute from the module's dotted
    ``name``."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            at = f"{where}:{getattr(child, 'lineno', 0)}"
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, at, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                pkg = ".".join(base[: len(base) - child.level + 1] if child.level else [])
                mod = ".".join(p for p in (pkg, child.module or "") if p)
                found.append(Import(mod, at, lazy, submodules=tuple(f"{mod}.{a.name}" for a in child.names)))
            elif (isinstance(child, ast.Call) and getattr(child.func, "id", getattr(child.func, "attr", None))
                  == "kernels" and child.args and isinstance(child.args[0], ast.Constant)):
                found.append(Import(child.args[0].value, at, True, handle=True))
            is_type_checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            visit(child, lazy or is_type_checking
                  or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def defined_names(source: str) -> set[str]:
    """The names a module binds at its top level (``__getattr__`` among them: then any name)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):  # if / try / with at the top level
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(node, field, []))

    visit(ast.parse(source).body)
    return names


def tree_files() -> dict[str, Path]:
    """Every module under specla/ and plugins/, by the name it installs as."""
    return {module_name(p): p for p in sorted([*(ROOT / "specla").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])}


FILES = tree_files()
MODULES = {name: imports(p.read_text(), name, p.name == "__init__.py", str(p.relative_to(ROOT)))
           for name, p in FILES.items()}
DEFINED = {name: defined_names(p.read_text()) for name, p in FILES.items()}
OURS = {"specla", *PLUGINS}
# where the tree's modules are imported from outside it (raw results are records of past runs)
USERS = [p for d in ("tests", "benchmarks", "examples") for p in sorted((ROOT / d).rglob("*.py"))
         if "results" not in p.relative_to(ROOT).parts]


def top(module: str) -> str:
    return module.split(".")[0]


def crossings(modules: dict[str, list[Import]]) -> list[str]:
    """Imports of a plugin package by the library or by another plugin package."""
    return [f"{imp.where} ({mod} imports {imp.module})" for mod, imps in modules.items() for imp in imps
            if top(imp.module) in PLUGINS and top(imp.module) != top(mod)]


APPS = "specla.apps"


def is_app(module: str) -> bool:
    return module == APPS or module.startswith(APPS + ".")


def app_imports(modules: dict[str, list[Import]]) -> list[str]:
    """Imports of an app (``specla.apps`` or a module of it, ``from specla import apps``
    included) by a module that is not an app."""
    return [f"{imp.where} ({mod} imports {used})" for mod, imps in modules.items() if not is_app(mod)
            for imp in imps for used in [next((m for m in (imp.module, *imp.submodules) if is_app(m)), None)]
            if used]


def requirement_import_name(requirement: str) -> str:
    dist = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()
    return IMPORT_NAMES.get(dist, dist.replace("-", "_"))


CORE = {requirement_import_name(r) for r in PYPROJECT["project"]["dependencies"]}
EXTRAS = {requirement_import_name(r) for reqs in PYPROJECT["project"]["optional-dependencies"].values()
          for r in reqs if not r.startswith(PYPROJECT["project"]["name"] + "[")} - CORE


def undeclared(modules: dict[str, list[Import]]) -> list[str]:
    """Third-party imports that are neither a declared requirement nor brought by one."""
    return [f"{imp.where} ({imp.module})" for imps in modules.values() for imp in imps
            if top(imp.module) not in sys.stdlib_module_names | OURS | CORE | EXTRAS | set(BROUGHT_BY)]


def eager_optional(modules: dict[str, list[Import]]) -> list[str]:
    """A module that imports a requirement of an extra at its top level must itself be imported
    only lazily, except by modules that import that requirement at their top level too: otherwise
    importing the library or a plugin would need the extra."""
    needs = {opt: {mod for mod, imps in modules.items() if any(not i.lazy and top(i.module) == opt for i in imps)}
             for opt in EXTRAS}
    return [f"{imp.where} ({mod} imports {used}, which imports {opt})"
            for opt, users in needs.items() for mod, imps in modules.items() if mod not in users
            for imp in imps if not imp.lazy
            for used in sorted(users.intersection((imp.module, *imp.submodules)))]


def test_the_tree_is_read():
    assert "specla_fla.plugin" in MODULES and "RecurrentMixer" in DEFINED["specla.mixers"]
    assert {"specla.apps.cli", "specla.apps.bench", "specla.apps.train_drafter"} <= MODULES.keys()
    assert any(p.relative_to(ROOT).parts[0] == "examples" for p in USERS)
    assert PLUGINS >= {"specla_fla", "specla_qwen"} and "specla" not in PLUGINS
    assert {"torch", "transformers", "pluggy"} <= CORE and {"fla", "triton", "pytest", "hypothesis"} <= EXTRAS


def test_no_plugin_imports_another_plugin_and_the_library_imports_none():
    assert not crossings(MODULES), "\n".join(crossings(MODULES))


def test_only_apps_tests_and_benchmarks_import_the_apps():
    examples = {str(p.relative_to(ROOT)): imports(p.read_text(), p.stem, False, str(p.relative_to(ROOT)))
                for p in USERS if p.relative_to(ROOT).parts[0] not in ("tests", "benchmarks")}
    bad = app_imports(MODULES) + app_imports(examples)
    assert not bad, "\n".join(bad)


def test_every_third_party_import_is_declared():
    assert not undeclared(MODULES), "\n".join(undeclared(MODULES))
    for module, dist in BROUGHT_BY.items():
        requires = [requirement_import_name(r) for r in importlib.metadata.requires(dist) or []
                    if "extra ==" not in r]
        assert module in requires, f"{dist} no longer requires {module}: declare it in pyproject"


def test_requirements_of_extras_load_only_where_they_are_used():
    assert not eager_optional(MODULES), "\n".join(eager_optional(MODULES))


def unresolved(imps: list[Import], defined: dict[str, set[str]]) -> list[str]:
    """Imports of the tree's packages that name no module of it, or a name its module does not
    bind (``from M import a``: ``a`` a submodule of ``M`` or a name ``M`` binds)."""
    bad = []
    for imp in imps:
        if top(imp.module) not in OURS:
            continue
        if imp.module not in defined:
            bad.append(f"{imp.where} (no module {imp.module})")
            continue
        names = defined[imp.module]
        bad += [f"{imp.where} ({imp.module} has no {sub.rsplit('.', 1)[1]})" for sub in imp.submodules
                if sub not in defined and sub.rsplit(".", 1)[1] not in names | {"*"} and "__getattr__" not in names]
    return bad


def test_every_import_of_the_tree_names_its_modules_and_names():
    """From the library, the plugins, the tests, the benchmarks and the examples."""
    imps = [imp for found in MODULES.values() for imp in found]
    imps += [imp for p in USERS for imp in imports(p.read_text(), p.stem, False, str(p.relative_to(ROOT)))]
    assert any(imp.handle for imp in imps), "no kernels(...) handle found"
    assert not unresolved(imps, DEFINED), "\n".join(unresolved(imps, DEFINED))


def test_the_checker_sees_each_kind_of_violation():
    """The rules on small made-up modules: each rule fires on its violation and not on the lazy
    or relative form that is allowed."""
    def mods(**sources):
        return {name: imports(src, name, False, name) for name, src in sources.items()}

    a, b = sorted(PLUGINS)[:2]
    assert crossings(mods(**{f"{b}.adapter": f"from {a}.mixer import M\nfrom .mtp import x\n"})) == \
        [f"{b}.adapter:1 ({b}.adapter imports {a}.mixer)"]
    assert crossings(mods(**{"specla.api": f"def f():\n    import {a}.plugin\n",
                             "specla.ops.k": f"h = kernels('{a}.verify')\n"})) == \
        [f"specla.api:2 (specla.api imports {a}.plugin)", f"specla.ops.k:1 (specla.ops.k imports {a}.verify)"]
    assert app_imports(mods(**{"specla.api": "def f():\n    from .apps.bench import run_bench\n",
                               f"{a}.plugin": "from specla import apps, config\n",
                               "examples/p.py": "import specla.apps.cli\n",
                               "specla.apps.cli": "from .demo import run_demo\nfrom .. import config\n"})) == \
        ["specla.api:2 (specla.api imports specla.apps.bench)", f"{a}.plugin:1 ({a}.plugin imports specla.apps)",
         "examples/p.py:1 (examples/p.py imports specla.apps.cli)"]
    assert undeclared(mods(**{"specla.x": "import os, torch\ndef f():\n    import requests\n"})) == \
        ["specla.x:3 (requests)"]
    eager = mods(**{"specla.k": "import triton\n", "specla.a": "from . import k\n",
                    "specla.b": "def f():\n    from .k import y\n", "specla.c": "import triton\nfrom .k import y\n"})
    assert eager_optional(eager) == ["specla.a:1 (specla.a imports specla.k, which imports triton)"]
    assert unresolved(imports("from specla.mixers import Mixer, Nothing\nimport specla.nothing\n"
                              "def f():\n    from specla.mixers import base\n", "t", False, "t"), DEFINED) == \
        ["t:1 (specla.mixers has no Nothing)", "t:2 (no module specla.nothing)"]
    assert [(i.lazy, i.handle) for i in imports("if TYPE_CHECKING:\n    import fla\nh = kernels('specla.ops.x')\n",
                                                "specla.m", False, "m")] == [(True, False), (True, True)]
