"""The conformance suite against the plugin named by ``--specla-plugin`` (collected only when this
package is named: ``pytest --pyargs specla.testing --specla-plugin=NAME``)."""

from specla.testing import PluginSuite


class TestConformance(PluginSuite):
    plugin = None  # from --specla-plugin
