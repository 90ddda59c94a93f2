"""Plugin discovery: a pluggy manager loading the ``specla.plugins`` entry points."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from functools import lru_cache
from pathlib import Path

import pluggy
import torch

from . import hookspecs
from .errors import PluginConflictWarning, PluginLoadWarning, UnknownPluginError, UnsupportedModelError
from .interfaces import ArchitecturePlugin


BUILTIN_DISTRIBUTION = "specla"  # the distribution of the bundled plugins, which win auto-detection


@dataclass(frozen=True)
class PluginInfo:
    """One architecture plugin as ``specla plugins`` lists it.

    Attributes:
        name: the architecture name (``plugin=``); for a plugin skipped before it named its
            architectures, its entry-point name.
        distribution, version: the distribution that installed it (``"?"`` when unknown).
        model_types: the ``config.model_type`` values it runs (empty for a skipped plugin).
        notes: one line per model type it shares with another plugin: which one auto-detection
            picks, or that :meth:`ArchitecturePlugin.claims` decides.
        error: why it was skipped (``None`` for a working plugin).
    """

    name: str
    distribution: str
    version: str
    model_types: tuple[str, ...]
    notes: tuple[str, ...] = ()
    error: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION

    @property
    def origin(self) -> str:
        """``"distribution version"``."""
        return f"{self.distribution} {self.version}"


class _Manager(pluggy.PluginManager):
    """pluggy's manager, plus the distribution each registered entry point came from and the
    entry points that failed to load."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.sources: dict[str, PluginInfo] = {}  # registered plugin name -> its entry point's origin
        self.failed: list[PluginInfo] = []
        self.limited_to: str | None = None  # SPECLA_PLUGINS as read, where it limited the loading


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _skip(source: PluginInfo, name: str, error: str) -> PluginInfo:
    """``source`` as a skipped plugin called ``name``, with a :class:`PluginLoadWarning` saying why."""
    warnings.warn(f"specla plugin {name!r} (entry point {source.name!r} of {source.origin}) is skipped: {error}",
                  PluginLoadWarning)
    return PluginInfo(name, source.distribution, source.version, (), error=error)


@lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with the ``specla.plugins`` entry points loaded: all of
    them, or only those named in the environment variable ``SPECLA_PLUGINS`` (comma-separated
    entry-point names, which for the bundled plugins are their architecture names; read once per
    process; set but empty or blank, it counts as unset). Each entry point is loaded on its own,
    the bundled ones first: one that fails to import (any exception, ``sys.exit`` included), or
    whose name another distribution's entry point already took, is skipped with a
    :class:`~specla.errors.PluginLoadWarning`.

    Raises:
        UnknownPluginError: ``SPECLA_PLUGINS`` names an entry point that is not installed (the
            message lists the installed ones), or names none (only commas and blanks: ``" , "``);
            nothing is loaded then.
    """
    pm = _Manager()
    found = entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    wanted = os.environ.get("SPECLA_PLUGINS")
    if wanted is not None and wanted.strip():  # set to nothing (`SPECLA_PLUGINS= specla ...`) is unset
        names = {n.strip() for n in wanted.split(",") if n.strip()}
        installed = {ep.name for ep in found}
        if not names:
            raise UnknownPluginError("SPECLA_PLUGINS is set but names no plugin; unset it to load every plugin")
        if names - installed:
            raise UnknownPluginError(f"SPECLA_PLUGINS names {', '.join(sorted(names - installed))}, which is not "
                                     f"an installed plugin entry point; installed: "
                                     f"{', '.join(sorted(installed)) or 'none'}")
        found = [ep for ep in found if ep.name in names]
        pm.limited_to = wanted
    sources = [(PluginInfo(ep.name, ep.dist.name if ep.dist else "?", ep.dist.version if ep.dist else "?", ()), ep)
               for ep in found]
    for source, ep in sorted(sources, key=lambda s: (not s[0].builtin, s[0].name, s[0].distribution)):
        if ep.name in pm.sources:
            pm.failed.append(_skip(source, ep.name, f"the entry point name is taken by {pm.sources[ep.name].origin}"))
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except (Exception, SystemExit) as err:  # sys.exit() at import skips that plugin, not the process
            pm.failed.append(_skip(source, ep.name, _one_line(err)))
        else:
            pm.sources[ep.name] = source
    return pm


class _BadHook(Exception):
    """A ``specla_architectures`` hook returned something other than architecture plugins."""


def _provided(impl: pluggy.HookImpl) -> list[ArchitecturePlugin]:
    """The architectures one plugin's ``specla_architectures`` hook returns.

    Raises:
        _BadHook: not an iterable of ``ArchitecturePlugin`` instances, each with a non-empty
            string ``name`` and a tuple (or list) of strings ``model_types``.
        whatever the hook raises.
    """
    result = impl.function()
    if result is None or isinstance(result, (str, bytes, ArchitecturePlugin)) or not isinstance(result, Iterable):
        raise _BadHook(f"specla_architectures() returned {type(result).__name__}, not a list of "
                       "ArchitecturePlugin instances")
    archs = list(result)
    for arch in archs:
        if not isinstance(arch, ArchitecturePlugin):
            raise _BadHook(f"specla_architectures() returned a {type(arch).__name__} in its list, not an "
                           "ArchitecturePlugin instance")
        name, model_types = getattr(arch, "name", None), getattr(arch, "model_types", None)
        if not isinstance(name, str) or not name:
            raise _BadHook(f"{type(arch).__name__}.name is {name!r}, not a non-empty string")
        if not isinstance(model_types, (tuple, list)) or not all(isinstance(t, str) for t in model_types):
            raise _BadHook(f"{type(arch).__name__}.model_types is {model_types!r}, not a tuple of strings")
    return archs


@dataclass(frozen=True)
class _Table:
    archs: dict[str, tuple[ArchitecturePlugin, PluginInfo]]  # name -> (architecture, its entry point's origin)
    infos: list[PluginInfo]  # the working ones, by name
    failed: list[PluginInfo]


@lru_cache(maxsize=1)
def _architectures() -> _Table:
    """Every plugin's architectures, each hook called on its own, the bundled plugins first: a
    plugin whose hook fails, or an architecture whose name an earlier one took, is skipped with a
    :class:`~specla.errors.PluginLoadWarning`; a third-party architecture declaring a model type a
    bundled one runs gets a :class:`~specla.errors.PluginConflictWarning` (once: the table is
    cached)."""
    pm = plugin_manager()
    archs: dict[str, tuple[ArchitecturePlugin, PluginInfo]] = {}
    failed = list(pm.failed)
    impls = {impl.plugin_name: impl for impl in pm.hook.specla_architectures.get_hookimpls()}
    for name, plugin in pm.list_name_plugin():  # registration order: the bundled plugins first
        if plugin is None:  # blocked by name
            continue
        source = pm.sources.get(name) or PluginInfo(name, "?", "?", ())  # registered by hand, not by entry point
        if name not in impls:
            failed.append(_skip(source, name, "it implements no specla_architectures hook (marked with "
                                              "specla.hookspecs.hookimpl)"))
            continue
        try:
            provided = _provided(impls[name])
        except _BadHook as err:
            failed.append(_skip(source, name, str(err)))
            continue
        except (Exception, SystemExit) as err:  # a hook's failure skips its plugin only
            failed.append(_skip(source, name, f"specla_architectures() raised {_one_line(err)}"))
            continue
        for arch in provided:
            if arch.name in archs:
                failed.append(_skip(source, arch.name, f"the architecture name {arch.name!r} is taken by "
                                                       f"{archs[arch.name][1].origin}"))
            else:
                archs[arch.name] = (arch, source)
    infos = []
    for name, (arch, source) in sorted(archs.items()):
        notes = []
        for model_type in arch.model_types:
            picked = [a.name for a, _ in _runners(model_type, archs)]
            if name not in picked:
                warnings.warn(f"specla plugin {name!r} ({source.origin}) declares model_type {model_type!r}, which "
                              f"the built-in plugin {' and '.join(map(repr, picked))} runs: auto-detection picks the "
                              f"built-in one; pass plugin={name!r} (--plugin {name}) to use {name!r}",
                              PluginConflictWarning)
                notes.append(f"{model_type}: auto-detection picks {', '.join(picked)} (built-in)")
            elif len(picked) > 1:
                notes.append(f"{model_type}: shared with {', '.join(p for p in picked if p != name)}; claims() decides")
        infos.append(PluginInfo(name, source.distribution, source.version, tuple(arch.model_types), tuple(notes)))
    return _Table(archs, infos, failed)


def _runners(model_type: str | None, archs: dict[str, tuple[ArchitecturePlugin, PluginInfo]]
             ) -> list[tuple[ArchitecturePlugin, PluginInfo]]:
    """The plugins auto-detection chooses among for ``model_type``: the built-in ones that run
    it, or, when none does, the third-party ones."""
    found = [(arch, source) for arch, source in archs.values() if model_type in arch.model_types]
    return [(arch, source) for arch, source in found if source.builtin] or found


def available() -> list[str]:
    """Sorted names of every working architecture plugin.

    A plugin that fails to load (its entry point does not import, or its hook raises or returns
    anything but ``ArchitecturePlugin`` instances, or its architecture name is taken: bundled
    plugins register first, then third-party ones by entry-point name) is left out with a
    :class:`~specla.errors.PluginLoadWarning` and listed by :func:`failed_plugins`. A third-party
    plugin declaring a model type a built-in one runs is listed: usable by name, never picked by
    :func:`detect_plugin` (see there).
    """
    return sorted(_architectures().archs)


def get_plugin(name: str) -> ArchitecturePlugin:
    """The architecture plugin called ``name``.

    Raises:
        UnknownPluginError: no such plugin (the message lists the available ones), or a plugin
            of that name failed to load (the message says why).
    """
    table = _architectures()
    if name in table.archs:
        return table.archs[name][0]
    for bad in table.failed:
        if bad.name == name:
            raise UnknownPluginError(f"plugin {name!r} ({bad.origin}) failed to load: {bad.error}")
    raise UnknownPluginError(f"unknown plugin {name!r}; available plugins: {', '.join(sorted(table.archs)) or 'none'}")


def plugin_infos() -> list[PluginInfo]:
    """Every working architecture (for ``specla plugins``), by name, with a note for each model
    type it shares with another plugin."""
    return list(_architectures().infos)


def failed_plugins() -> list[PluginInfo]:
    """The plugins skipped because they failed to load, each with its ``error``."""
    return list(_architectures().failed)


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


def limited_loading(what: str) -> str:
    """`` (WHAT, as SPECLA_PLUGINS='...' limits loading; unset it to load every plugin)`` where
    that variable limited which plugins loaded, else ``""``: a message about the loaded plugins
    ends with it, or an installed plugin would seem missing."""
    if (limited := plugin_manager().limited_to) is None:
        return ""
    return f" ({what}, as SPECLA_PLUGINS={limited!r} limits loading; unset it to load every plugin)"


def detect_plugin(model: torch.nn.Module | str | Path) -> ArchitecturePlugin:
    """The plugin whose ``model_types`` contains the model's ``config.model_type``.

    When plugins disagree: a built-in plugin (one of the ``specla`` distribution) that runs the
    model type wins over every third-party one (which stays usable by name, ``plugin=``, and was
    announced by a :class:`~specla.errors.PluginConflictWarning`). Among several built-in ones,
    the first whose :meth:`ArchitecturePlugin.claims` accepts the model is picked; among several
    third-party ones, the one ``claims`` singles out, and none when it singles out none.

    Raises:
        UnsupportedModelError: ``model`` is neither a ``torch.nn.Module`` nor a path, no
            registered plugin runs its model type (or it has none), several third-party plugins
            run it and their ``claims`` do not single one out (the message names them: pass
            ``plugin=``), or a checkpoint directory's ``config.json`` is not a valid JSON object.
    """
    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise UnsupportedModelError(f"a model is a torch.nn.Module (transformers' or FLA's class) or a checkpoint "
                                    f"directory, got {type(model).__name__}")
    model_type = model_type_of(model)
    runners = _runners(model_type, _architectures().archs)
    matches = [arch for arch, _ in runners]
    if len(matches) > 1:  # one model_type, several implementations: each plugin says whether it is its own
        probe = json.loads((Path(model) / "config.json").read_text()) if isinstance(model, (str, Path)) else model
        claimed = [arch for arch in matches if arch.claims(probe)]
        if len(claimed) != 1 and not runners[0][1].builtin:  # third-party plugins are not ordered: no silent pick
            names = " and ".join(f"{arch.name!r} ({source.origin})" for arch, source in runners
                                 if arch in (claimed or matches))
            raise UnsupportedModelError(f"the plugins {names} all run model_type {model_type!r} and their claims() "
                                        f"do not single one out for this model: pass plugin= (the CLI's --plugin) "
                                        f"naming one")
        matches = claimed or matches
    if matches:
        return matches[0]
    known = ", ".join(f"{n} ({', '.join(a.model_types)})" for n, (a, _) in _architectures().archs.items()) or "none"
    known += limited_loading("only these")
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
