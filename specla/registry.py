"""Plugin discovery: a pluggy manager loading the ``specla.plugins`` entry points."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from functools import lru_cache
from pathlib import Path

import pluggy
import torch

from . import hookspecs
from .errors import UnknownPluginError, UnsupportedModelError
from .interfaces import ArchitecturePlugin


@dataclass(frozen=True)
class PluginInfo:
    """One registered architecture: its name, the distribution that installed it, and version."""

    name: str
    distribution: str
    version: str
    model_types: tuple[str, ...]


@lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with the ``specla.plugins`` entry points loaded: all of
    them, or only those named in the environment variable ``SPECLA_PLUGINS`` (comma-separated
    entry-point names, which for the bundled plugins are their architecture names; read once per
    process).

    Raises:
        UnknownPluginError: ``SPECLA_PLUGINS`` names an entry point that is not installed (the
            message lists the installed ones), or is set but empty; nothing is loaded then.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    wanted = os.environ.get("SPECLA_PLUGINS")
    if wanted is None:
        pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
        return pm
    names = {n.strip() for n in wanted.split(",") if n.strip()}
    installed = {ep.name for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP)}
    if not names:
        raise UnknownPluginError("SPECLA_PLUGINS is set but names no plugin; unset it to load every plugin")
    if names - installed:
        raise UnknownPluginError(f"SPECLA_PLUGINS names {', '.join(sorted(names - installed))}, which is not an "
                                 f"installed plugin entry point; installed: {', '.join(sorted(installed)) or 'none'}")
    for name in sorted(names):
        pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP, name=name)
    return pm


@lru_cache(maxsize=1)
def _architectures() -> dict[str, tuple[ArchitecturePlugin, object]]:
    """name -> (architecture, the registered plugin module that provided it)."""
    found: dict[str, tuple[ArchitecturePlugin, object]] = {}
    for impl in plugin_manager().hook.specla_architectures.get_hookimpls():
        for arch in impl.function():
            if arch.name in found:
                raise RuntimeError(f"two plugins register the architecture name {arch.name!r}")
            found[arch.name] = (arch, impl.plugin)
    return found


def available() -> list[str]:
    """Sorted names of every registered architecture plugin."""
    return sorted(_architectures())


def get_plugin(name: str) -> ArchitecturePlugin:
    """The architecture plugin called ``name``.

    Raises:
        UnknownPluginError: no such plugin; the message lists the available ones.
    """
    archs = _architectures()
    if name not in archs:
        raise UnknownPluginError(f"unknown plugin {name!r}; available plugins: {', '.join(sorted(archs)) or 'none'}")
    return archs[name][0]


def plugin_infos() -> list[PluginInfo]:
    """Name, distribution and version of every registered architecture (for ``specla plugins``)."""
    dists = {id(mod): dist for mod, dist in plugin_manager().list_plugin_distinfo()}
    out = []
    for name, (arch, module) in sorted(_architectures().items()):
        dist = dists.get(id(module))
        out.append(
            PluginInfo(
                name,
                dist.project_name if dist else "?",
                dist.version if dist else "?",
                tuple(arch.model_types),
            )
        )
    return out


def model_type_of(model: torch.nn.Module | str | Path) -> str | None:
    """``config.model_type`` of a loaded model or of a checkpoint directory's ``config.json``
    (``None`` when the directory has no ``config.json``).

    Raises:
        UnsupportedModelError: the ``config.json`` is not valid JSON or not a JSON object (the
            message names the file and the problem).
    """
    if isinstance(model, (str, Path)):
        cfg = Path(model) / "config.json"
        if not cfg.is_file():
            return None
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UnsupportedModelError(f"{cfg} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise UnsupportedModelError(f"{cfg} is not a JSON object (got {type(data).__name__})")
        return data.get("model_type")
    return getattr(getattr(model, "config", None), "model_type", None)


def detect_plugin(model: torch.nn.Module | str | Path) -> ArchitecturePlugin:
    """The plugin whose ``model_types`` contains the model's ``config.model_type`` (among several,
    the first whose :meth:`ArchitecturePlugin.claims` accepts the model).

    Raises:
        UnsupportedModelError: ``model`` is neither a ``torch.nn.Module`` nor a path, no
            registered plugin runs its model type (or it has none), or a checkpoint
            directory's ``config.json`` is not a valid JSON object.
    """
    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise UnsupportedModelError(f"a model is a torch.nn.Module (transformers' or FLA's class) or a checkpoint "
                                    f"directory, got {type(model).__name__}")
    model_type = model_type_of(model)
    matches = [arch for arch, _ in _architectures().values() if model_type in arch.model_types]
    if len(matches) > 1:  # one model_type, several implementations: each plugin says whether it is its own
        probe = json.loads((Path(model) / "config.json").read_text()) if isinstance(model, (str, Path)) else model
        matches = [arch for arch in matches if arch.claims(probe)] or matches
    if matches:
        return matches[0]
    known = {n: a.model_types for n, (a, _) in _architectures().items()}
    if model_type is None:
        if isinstance(model, torch.nn.Module):
            what = f"{type(model).__name__} has no config.model_type"
        else:
            from .drafters.eagle import is_eagle_dir

            if is_eagle_dir(model):
                raise UnsupportedModelError(f"{model} is a trained drafter (an EAGLE head), not a target model: pass it "
                                            "as drafter= (the CLI's --drafter) beside the target it was trained for")
            cfg = Path(model) / "config.json"
            what = f"{cfg} has no model_type" if cfg.is_file() else f"{model} has no config.json"
        raise UnsupportedModelError(f"no plugin runs model_type None ({what}); name one with plugin=, or pass "
                                    f"a model of a registered plugin: {known}")
    raise UnsupportedModelError(f"no plugin runs model_type {model_type!r}; registered plugins: {known}")
