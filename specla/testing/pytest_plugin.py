"""pytest plugin (entry point ``pytest11``): the ``--specla-plugin=NAME`` option of the suite."""


def pytest_addoption(parser):
    parser.addoption("--specla-plugin", dest="specla_plugin", default=None,
                     help="run specla's conformance suite (pytest --pyargs specla.testing) against this plugin")


def pytest_collection_modifyitems(config, items):
    """The packaged suite (``pytest --pyargs specla.testing``) collected without a usable
    ``--specla-plugin``: one usage error before anything runs, not one setup error per test."""
    if not any(getattr(item, "cls", None) is not None
               and item.cls.__module__ == "specla.testing.test_conformance" for item in items):
        return
    import pytest

    from ..errors import SpecError
    from ..registry import get_plugin

    name = config.getoption("specla_plugin", None)
    if not name:
        raise pytest.UsageError("no plugin named: pass --specla-plugin=NAME (`specla plugins` lists them)")
    try:
        get_plugin(name)
    except SpecError as err:
        raise pytest.UsageError(f"--specla-plugin={name}: {err}") from None
