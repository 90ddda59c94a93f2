"""The gla plugin against specla's packaged conformance suite (specla.testing)."""

from specla.testing import PluginSuite


class TestGLAConformance(PluginSuite):
    plugin = "gla"
