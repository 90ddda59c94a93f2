"""The conformance suite's entry points: --specla-plugin through pytest, check_plugin, errors;
what the mixers call their states."""

import subprocess
import sys

import pytest

from specla.config import SpecConfig
from specla.errors import UnknownPluginError
from specla.registry import available, get_plugin
from specla.testing import check_plugin


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_check_plugin_runs_the_packaged_suite_against_an_installed_plugin():
    proc = run("from specla.testing import check_plugin; import sys; "
               "sys.exit(0 if check_plugin('gdn', '-k', 'verify_never_writes or bad_input') else 1)")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


def test_pytest_option_names_the_plugin_and_without_it_the_suite_says_so():
    base = [sys.executable, "-m", "pytest", "--pyargs", "specla.testing", "-p", "no:cacheprovider", "-q", "-rs"]
    named = subprocess.run(base + ["--specla-plugin=gdn", "-k", "verify_never_writes"], capture_output=True,
                           text=True, timeout=600)
    assert named.returncode == 0 and "1 passed" in named.stdout, named.stdout[-2000:]
    unnamed = subprocess.run(base + ["-k", "verify_never_writes"], capture_output=True, text=True, timeout=600)
    assert unnamed.returncode != 0, "a run that names no plugin must not pass"
    assert "pass --specla-plugin=NAME" in unnamed.stdout, unnamed.stdout[-2000:]


def test_check_plugin_rejects_an_unknown_plugin_before_running_anything():
    with pytest.raises(UnknownPluginError, match="gdn"):
        check_plugin("no-such-architecture")


def test_specla_plugins_env_limits_loading_and_names_unknown_plugins():
    import os

    code = "from specla.registry import available; print(available())"
    env = {**os.environ, "SPECLA_PLUGINS": "gdn"}
    only = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert only.returncode == 0 and only.stdout.strip() == "['gdn']", only.stderr[-1000:]
    env["SPECLA_PLUGINS"] = " , "
    empty = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert empty.returncode != 0 and "SPECLA_PLUGINS is set but names no plugin" in empty.stderr
    env["SPECLA_PLUGINS"] = "gdn, nope"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0
    assert "SPECLA_PLUGINS names nope, which is not an installed plugin entry point; installed: " in bad.stderr
    assert "gdn" in bad.stderr.splitlines()[-1]


def test_the_example_third_party_plugin_is_registered_through_its_entry_point_alone():
    """examples/third_party_plugin is installed by the test command and found without any
    change to specla (its own tests run the conformance suite)."""
    from specla.registry import available, plugin_infos

    assert {"gdn", "mamba2", "retention"} <= set(available())
    info = {i.name: i for i in plugin_infos()}["retention"]
    assert info.distribution == "specla-retention-example" and info.model_types == ("tiny_retention",)


def test_a_known_failure_naming_no_suite_test_fails_the_run():
    """A stale or misspelt known_failures key must not pass unnoticed (patched in a subprocess)."""
    proc = subprocess.run([sys.executable, "-c", "import specla.registry as r, specla.testing as t, sys; "
                           "type(r.get_plugin('gdn')).known_failures = {'test_no_such_check': 'typo'}; "
                           "sys.exit(0 if t.check_plugin('gdn', '-k', 'verify_never_writes') else 1)"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "declares known failures for tests the suite does not have: ['test_no_such_check']" in proc.stdout


@pytest.mark.parametrize("plugin", available())
def test_every_installed_mixer_names_each_of_its_states(plugin):
    """What a diagnosis calls each state tensor of every tiny variant's mixers."""
    arch = get_plugin(plugin)
    known = {"recurrent", "conv window", "key cache", "value cache", "key/value cache", "cache length"}
    for variant in arch.tiny_variants:
        for m in arch.make_adapter(arch.tiny_model(variant), SpecConfig()).mixers:
            names = m.state_names()
            assert len(names) == len(m.state()) and set(names) <= known, (variant, type(m).__name__, names)
