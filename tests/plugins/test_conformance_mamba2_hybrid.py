"""The mamba2_hybrid plugin (transformers' Mamba2 family: Mamba2 and attention mixers) against
specla's packaged conformance suite (specla.testing)."""

from specla.testing import PluginSuite


class TestMamba2HybridConformance(PluginSuite):
    plugin = "mamba2_hybrid"
