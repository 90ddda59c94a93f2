"""The lfm2 plugin (short-convolution and attention mixers) against specla's packaged conformance
suite (specla.testing)."""

from specla.testing import PluginSuite


class TestLfm2Conformance(PluginSuite):
    plugin = "lfm2"
