"""The conformance suite every architecture plugin passes (docs/DESIGN.md section 7; docs/plugins.md).

- :class:`PluginSuite`: un-collected base class; a plugin's test file subclasses it
  (``class TestMyArch(PluginSuite): plugin = "myarch"``).
- ``pytest --pyargs specla.testing --specla-plugin=NAME``: the suite against any installed plugin.
- :func:`check_plugin`: the same without writing a pytest command line.
- :func:`diagnose`: where a speculative run first leaves plain decoding (sequence, step, layer,
  state), what the suite reports when a token comparison fails.
- :class:`OracleDrafter`: a drafter that forces acceptance patterns; :func:`path_acceptance`: the
  acceptance of chosen paths of a tree.
"""

from __future__ import annotations

from .drafters import OracleDrafter, path_acceptance

__all__ = ["Divergence", "OracleDrafter", "PluginSuite", "check_plugin", "diagnose", "path_acceptance"]


def __getattr__(name: str):
    """``PluginSuite`` and the diagnosis on first use: the suite imports pytest (the ``test``
    extra) and the diagnosis the decoder, which the runtime helpers of this package (the
    transformers oracle, which plugins import, and :class:`OracleDrafter`) do not need."""
    if name == "PluginSuite":
        from .suite import PluginSuite

        return PluginSuite
    if name in ("Divergence", "diagnose"):
        from . import diagnosis

        return getattr(diagnosis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_plugin(name: str, *pytest_args: str) -> bool:
    """Run the conformance suite against the installed plugin ``name`` (in this process).

    Args:
        name: a registered plugin name (``specla plugins`` lists them).
        pytest_args: extra pytest arguments (e.g. ``"-x"``, ``"-k", "ragged"``).
    Returns:
        ``True`` when every test passed (strict xfails included), else ``False``.
    Raises:
        UnknownPluginError: no plugin of that name is installed (raised before any test runs).
    """
    import pytest

    from ..registry import get_plugin

    get_plugin(name)
    code = pytest.main(["--pyargs", "specla.testing.test_conformance", f"--specla-plugin={name}",
                        "-p", "no:cacheprovider", "-q", *pytest_args])
    return code == pytest.ExitCode.OK
