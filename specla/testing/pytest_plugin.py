"""pytest plugin (entry point ``pytest11``): the ``--specla-plugin=NAME`` option of the suite."""


def pytest_addoption(parser):
    parser.addoption("--specla-plugin", dest="specla_plugin", default=None,
                     help="run specla's conformance suite (pytest --pyargs specla.testing) against this plugin")
