"""The kimi_linear plugin (KDA and MLA mixers) against specla's packaged conformance suite
(specla.testing)."""

from specla.testing import PluginSuite


class TestKimiLinearConformance(PluginSuite):
    plugin = "kimi_linear"
