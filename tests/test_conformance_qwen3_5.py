"""The qwen3_5 hybrid plugin (GDN and attention mixers) against specla's packaged conformance
suite (specla.testing)."""

from specla.testing import PluginSuite


class TestQwen3_5Conformance(PluginSuite):
    plugin = "qwen3_5"
