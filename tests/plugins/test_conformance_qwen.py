"""The qwen hybrid plugin (GDN and attention mixers) against specla's packaged conformance
suite (specla.testing)."""

from specla.testing import PluginSuite


class TestQwenConformance(PluginSuite):
    plugin = "qwen"
