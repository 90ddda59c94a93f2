"""The gdn plugin against specla's packaged conformance suite (specla.testing)."""

from specla.testing import PluginSuite


class TestGDNConformance(PluginSuite):
    plugin = "gdn"
