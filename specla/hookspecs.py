"""pluggy hook specifications of the ``specla`` project.

A plugin package exposes a module (or object) through the ``specla.plugins`` entry-point group;
pluggy registers it and calls the hooks it implements (marked with :data:`hookimpl`)::

    [project.entry-points."specla.plugins"]
    myarch = "myarch_specla.plugin"
"""

from __future__ import annotations

import pluggy

PROJECT = "specla"
ENTRY_POINT_GROUP = "specla.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def specla_architectures() -> list:
    """Return the :class:`specla.interfaces.ArchitecturePlugin` instances this plugin provides
    (usually one). Names must be unique across all installed plugins: an architecture whose name
    an earlier plugin took (the bundled plugins register first) is skipped, and so is the whole
    plugin when this hook raises or returns anything else, each with a
    :class:`specla.errors.PluginLoadWarning` (docs/plugins.md, "A plugin that fails to load")."""
