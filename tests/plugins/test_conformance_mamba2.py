"""The mamba2 plugin against specla's packaged conformance suite (specla.testing)."""

from specla.testing import PluginSuite


class TestMamba2Conformance(PluginSuite):
    plugin = "mamba2"
