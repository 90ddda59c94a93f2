"""The example plugin proves itself with specla's packaged conformance suite: this is all."""

from specla.testing import PluginSuite


class TestRetentionConformance(PluginSuite):
    plugin = "retention"
