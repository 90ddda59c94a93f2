"""The conformance suite's entry points: --specla-plugin through pytest, check_plugin, errors;
its diagnosis of a failed token comparison (specla.testing.diagnose) on deliberately broken
commits of the gdn plugin."""

import math
import random
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from specla.config import SpecConfig
from specla.errors import UnknownPluginError
from specla.mixers import AttentionMixer
from specla.registry import available, get_plugin
from specla.testing import OracleDrafter, PluginSuite, check_plugin, diagnose
from specla.model.adapter import ModelAdapter
from specla.testing.diagnosis import compare_states


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
    assert unnamed.returncode == 4, "a run that names no plugin must not pass"  # pytest's usage error
    assert "ERROR: no plugin named: pass --specla-plugin=NAME" in unnamed.stderr, unnamed.stderr[-2000:]
    unknown = subprocess.run(base + ["--specla-plugin=nosuch", "-k", "verify_never_writes"], capture_output=True,
                             text=True, timeout=600)
    assert unknown.returncode == 4 and "ERROR: --specla-plugin=nosuch: " in unknown.stderr, unknown.stderr[-2000:]
    assert "error" not in unknown.stdout.lower(), unknown.stdout[-2000:]  # no per-test setup errors


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


@pytest.mark.parametrize("value", ["", "  "])
def test_specla_plugins_set_but_empty_loads_every_plugin_as_if_unset(value):
    """``SPECLA_PLUGINS=`` (as a shell clears a variable) made every command and every
    ``specla.run`` fail; empty or blank, it is unset."""
    import os

    code = "from specla.registry import available; print(available())"
    unset = {k: v for k, v in os.environ.items() if k != "SPECLA_PLUGINS"}
    every = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=unset, timeout=300)
    empty = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**unset, "SPECLA_PLUGINS": value}, timeout=300)
    assert every.returncode == 0 and empty.returncode == 0, empty.stderr[-1000:]
    assert empty.stdout == every.stdout and "'gdn'" in every.stdout and "'qwen'" in every.stdout


def test_no_plugin_for_a_model_type_says_when_specla_plugins_limited_the_plugins(tmp_path):
    import os

    (tmp_path / "config.json").write_text('{"model_type": "delta_net"}')
    code = f"from specla.registry import detect_plugin; detect_plugin({str(tmp_path)!r})"
    env = {**os.environ, "SPECLA_PLUGINS": "gdn"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stderr.splitlines()[-1] == (
        "specla.errors.UnsupportedModelError: no plugin runs model_type 'delta_net'; registered plugins: gdn "
        "(gated_deltanet) (only these, as SPECLA_PLUGINS='gdn' limits loading; unset it to load every plugin)")


def test_no_demo_checkpoint_says_when_specla_plugins_limited_the_plugins():
    import os

    env = {**os.environ, "SPECLA_PLUGINS": "lfm2,gdn"}  # neither ships one; qwen's is not loaded
    out = subprocess.run([sys.executable, "-m", "specla.apps.cli", "demo"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (
        "specla: error: no installed plugin ships a demo checkpoint (only gdn, lfm2 loaded, as "
        "SPECLA_PLUGINS='lfm2,gdn' limits loading; unset it to load every plugin)")


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


# ---------------------------------------------------------------- the diagnosis of a failed comparison
# Broken commits of the gdn adapter (ModelAdapter._commit: the decoding steps' commit; the
# prefill, plain decoding's state in the diagnosis, commits through the mixers alone), each around
# the adapter's own methods, kept here before a test patches them.
COMMIT, VERIFY = ModelAdapter._commit, ModelAdapter._verify


def commit_next_node(self, tree, out, acceptance):
    """Commits the state of the node after the last accepted one (the first rejected draft,
    where there is one) instead of the last accepted node's."""
    last = acceptance.num_accepted[:, None]
    end = acceptance.path.gather(1, last)
    path = acceptance.path.scatter(1, last, torch.minimum(end + 1, tree.num_nodes[:, None]))
    COMMIT(self, tree, out, replace(acceptance, path=path))


def commit_keeping_windows(self, tree, out, acceptance):
    """Moves the recurrent states but leaves every conv window where it was."""
    windows = [m.conv for m in self.mixers]
    COMMIT(self, tree, out, acceptance)
    self.flush()  # a delayed commit moves the windows when it is applied
    for m, window in zip(self.mixers, windows):
        m.conv = window


def commit_one_draft_less(self, tree, out, acceptance):
    """Off by one in the accepted length: the last accepted draft never reaches the state."""
    fewer = (acceptance.num_accepted - 1).clamp(min=0)
    COMMIT(self, tree, out, replace(acceptance, num_accepted=fewer))


def commit_root_into_caches(self, tree, out, acceptance):
    """The attention layers' cache length grows by the root alone, whatever was accepted."""
    lengths = [m.cache_len if isinstance(m, AttentionMixer) else None for m in self.mixers]
    COMMIT(self, tree, out, acceptance)
    self.flush()
    for m, length in zip(self.mixers, lengths):
        if length is not None:
            m.cache_len = length + 1


def forced_acceptance_failure(monkeypatch, commit) -> str:
    """The message of the suite's forced-acceptance test (factor commit) on the gdn plugin
    with ``commit`` as its adapter's commit."""
    monkeypatch.setattr(ModelAdapter, "_commit", commit)
    with pytest.raises(AssertionError) as failure:
        PluginSuite().test_forced_acceptance_patterns_token_identical(get_plugin("gdn"), random.Random(1234), "factor")
    return str(failure.value)


def assert_finite_difference(message: str) -> None:
    """The message's ``max |d| X (rel Y)`` has finite positive X and Y."""
    (x, y), = re.findall(r"max \|d\| (\S+) \(rel (\S+)\)", message)
    assert 0 < float(x) < math.inf and 0 < float(y) < math.inf, message


@pytest.mark.parametrize("commit, pattern, accepted, state, mismatch, plain_ok", [
    (commit_next_node, "none", "0 accepted drafts", "recurrent", "position 1: 15 != 31", True),
    (commit_keeping_windows, "all", "6 accepted drafts", "conv window", "position 7: 44 != 4", False),
])
def test_a_broken_commit_fails_the_suite_naming_the_sequence_step_layer_and_state(monkeypatch, commit, pattern,
                                                                                   accepted, state, mismatch,
                                                                                   plain_ok):
    """The suite's forced acceptance patterns against a gdn adapter that commits the wrong node,
    or skips the conv window: the first pattern that fails names where it left plain decoding."""
    message = forced_acceptance_failure(monkeypatch, commit)
    # a commit that skips the conv window breaks plain decoding too (its one-token steps commit
    # through it), and the message says so before the re-run's finding
    head = (r"speculative output differs from plain decoding" if plain_ok else
            r"specla's plain decoding \(no drafts\) already differs from the plugin's reference_decode \(prompt \d+, "
            r"from new token \d+: \[[\d, ]+\] against \[[\d, ]+\]\): the fault is in what plain decoding runs too "
            r"\(the model spec's mixers, block wiring, norms or head, or a mixer's verify or commit\), not in the "
            r"speculation; the step-by-step re-run")
    assert re.fullmatch(rf"pattern '{pattern}': {head}: sequence 0, step 1 "
                        rf"\(after committing {accepted}\): layer 0 '{state}' state differs from plain decoding's by "
                        rf"max \|d\| \S+ \(rel \S+\); first token mismatch at {mismatch}", message), message
    assert_finite_difference(message)


def test_a_wrong_model_spec_fails_the_suite_naming_plain_decoding_not_speculation(monkeypatch):
    """Logits that are not the model's (token 5 raised in every verify, as a wrong spec would)
    fail the suite's token checks with a message that puts the fault before speculation:
    specla's own plain decoding already differs from ``reference_decode``."""
    model, prompts, refs, drafter = mixed_batch()
    real = ModelAdapter._verify

    def shifted_logits(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.logits[..., 5] += 1e3  # token 5 wins every step: not the model reference_decode runs
        return out

    monkeypatch.setattr(ModelAdapter, "_verify", shifted_logits)
    with pytest.raises(AssertionError) as err:
        PluginSuite._check_outputs(get_plugin("gdn"), model, prompts, [[5] * 12 for _ in prompts],
                                   [r[:12] for r in refs], "case", config=dict(num_draft_tokens=6, max_new_tokens=12))
    assert re.fullmatch(r"case: specla's plain decoding \(no drafts\) already differs from the plugin's "
                        r"reference_decode \(prompt 0, from new token 0: \[5, 5, 5, 5\] against \[\d+, \d+, \d+, "
                        r"\d+\]\): the fault is in what plain decoding runs too \(the model spec's mixers, block "
                        r"wiring, norms or head, or a mixer's verify or commit\), not in the speculation; the "
                        r"step-by-step re-run: .+", str(err.value)), str(err.value)


def test_the_accepted_count_check_names_the_state_that_differs(monkeypatch):
    """The adapter-level check (commit a chain of a accepted drafts, compare the next logits with
    a fresh prefill's) names the state too, not only ``a``."""
    monkeypatch.setattr(ModelAdapter, "_commit", commit_keeping_windows)
    with pytest.raises(AssertionError) as failure:
        PluginSuite().test_every_accepted_count_commits_exactly_the_accepted_tokens(get_plugin("gdn"),
                                                                                    random.Random(1234), "factor")
    message = str(failure.value)
    assert re.fullmatch(r"a = 0: after committing 0 accepted drafts the next logits differ from a fresh prefill's of "
                        r"the same tokens by max \|d\| \S+; layer 0 'conv window' state differs from plain decoding's "
                        r"by max \|d\| \S+ \(rel \S+\)", message), message
    assert_finite_difference(message)


def bump_first_state(self):
    """A write into the first mixer's recurrent state, where no write belongs."""
    self.mixers[0].state()[0].add_(1)


def verify_writing_the_state(self, tree):
    bump_first_state(self)
    return ADAPTER_VERIFY(self, tree)


def flush_writing_the_state(self):
    ADAPTER_FLUSH(self)
    bump_first_state(self)


ADAPTER_VERIFY, ADAPTER_FLUSH = ModelAdapter.verify, ModelAdapter.flush


@pytest.mark.parametrize("method, broken, test, message", [
    ("verify", verify_writing_the_state, "test_verify_never_writes_the_state",
     r"verifying the same tree again changed mixer 0's 'recurrent' state \(max \|d\| 1\)"),
    ("verify", verify_writing_the_state, "test_bad_input_raises_by_name_and_leaves_the_state_untouched",
     r"a refused tree or prompt changed mixer 0's 'recurrent' state \(max \|d\| \d\)"),
    ("flush", flush_writing_the_state, "test_delayed_commit_equals_flushed_and_flush_is_idempotent",
     r"the next logits after a delayed commit and after a flushed one differ by max \|d\| \S+ \(tolerance \S+\); "
     r"first beyond it: mixer 0's 'recurrent' state \(max \|d\| 1\)"),
])
def test_a_state_written_where_it_must_not_be_is_named_with_its_difference(monkeypatch, method, broken, test,
                                                                          message):
    """The suite's checks that a verify, a refused input or a flush leaves the state as it was
    name the mixer and state that changed, with the largest difference."""
    monkeypatch.setattr(ModelAdapter, method, broken)
    with pytest.raises(AssertionError) as failure:
        getattr(PluginSuite(), test)(get_plugin("gdn"), random.Random(1234))
    first = str(failure.value).splitlines()[0]  # pytest's rewritten assert adds the expression's lines
    assert re.fullmatch(message, first), str(failure.value)


def mixed_batch(variant="base"):
    """A tiny gdn model, a ragged batch, its reference continuations and the oracle drafter of the
    ``mixed`` pattern (sequence 0 drafts nothing, the others their whole right chain)."""
    arch = get_plugin("gdn")
    model = arch.tiny_model(variant)
    rng = random.Random(7)
    prompts = [[rng.randrange(61) for _ in range(n)] for n in (4, 9, 2)]
    refs = [arch.reference_decode(model, p, 18) for p in prompts]
    return model, prompts, refs, OracleDrafter(prompts, refs, "mixed", 61)


def test_diagnose_names_the_first_sequence_whose_state_differs(monkeypatch):
    """One draft less: sequence 0 drafts nothing, so sequence 1 is the first to diverge."""
    monkeypatch.setattr(ModelAdapter, "_commit", commit_one_draft_less)
    model, prompts, refs, drafter = mixed_batch()
    cfg = SpecConfig(num_draft_tokens=6, max_depth=6, max_new_tokens=12)
    found = diagnose("gdn", model, prompts, [r[:12] for r in refs], drafter=drafter, config=cfg)
    d = found.difference
    assert (found.sequence, found.step, found.accepted, d.layer, d.state) == (1, 1, 6, 0, "recurrent")
    assert 0 < d.max_abs < math.inf and 0 < d.rel < math.inf
    assert (found.position, found.token, found.expected) == (7, 15, 47)


def test_diagnose_names_a_hybrids_attention_layer_and_its_cache():
    """gdn's ``attn`` variant holds softmax attention at layer 1: a commit that grows its cache
    by the root alone is named there, by the state the attention mixer calls it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelAdapter, "_commit", commit_root_into_caches)
        model, prompts, refs, drafter = mixed_batch("attn")
        found = diagnose("gdn", model, prompts, drafter=drafter, config=dict(num_draft_tokens=6, max_new_tokens=12))
    # sequence 1: 9 prompt tokens and 7 committed, 15 in the state; its cache holds 9
    assert str(found) == ("sequence 1, step 1 (after committing 6 accepted drafts): layer 1 'cache length' state "
                          "differs from plain decoding's by max |d| 6 (rel 0.4); first token mismatch at position 10: "
                          "5 != 19")


def test_diagnose_refuses_expected_outputs_that_do_not_match_the_prompts():
    with pytest.raises(ValueError, match="^expected holds 1 outputs for 2 prompts$"):
        diagnose("no-such-plugin", None, [[1], [2]], [[3]])


def verify_with_shifted_draft_logits(self, tree):
    """The draft nodes' logits moved one token up the vocabulary (the root's stay right)."""
    out = VERIFY(self, tree)
    return replace(out, logits=torch.cat([out.logits[:, :1], out.logits[:, 1:].roll(1, dims=-1)], 1))


def test_diagnose_without_a_state_difference_names_the_first_token_mismatch(monkeypatch):
    """Wrong logits with right states: the tokens differ while every committed state is plain
    decoding's after the same tokens."""
    monkeypatch.setattr(ModelAdapter, "_verify", verify_with_shifted_draft_logits)
    model, prompts, refs, drafter = mixed_batch()
    found = diagnose("gdn", model, prompts, drafter=drafter, config=dict(num_draft_tokens=6, max_new_tokens=12))
    assert str(found) == ("sequence 1: every state equals plain decoding's before every verify (the verify's logits or "
                          "the acceptance differ); first token mismatch at position 1: 47 != 46")


@pytest.mark.parametrize("commit", ["factor", "replay"])
@pytest.mark.parametrize("cuda_graphs", ["off", "unrecorded"])
def test_diagnose_finds_nothing_in_a_correct_plugin(commit, cuda_graphs):
    """The gdn plugin as shipped: every state and token equals plain decoding's, in eager steps and
    in the fixed-shape (graph) step whose batches keep finished rows as dead copies."""
    model, prompts, refs, drafter = mixed_batch()
    stop = refs[2][3]  # sequence 2 stops early
    cfg = SpecConfig(num_draft_tokens=6, max_depth=6, max_new_tokens=12, stop_token_ids=(stop,),
                     engine=dict(commit=commit, cuda_graphs=cuda_graphs))
    assert diagnose("gdn", model, prompts, drafter=drafter, config=cfg) is None
    assert diagnose("gdn", model, prompts, drafter=OracleDrafter(prompts, refs, "tree", 61), config=cfg) is None


def test_compare_states_names_the_model_layer_of_a_hybrids_mixer():
    """Nemotron-H's tiny model: Mamba2 at layers 0 and 4, attention at 1, MLP and MoE layers
    between (no mixer): the third mixer's state is named as layer 4's, with the exact difference."""
    arch = get_plugin("mamba2_hybrid")
    model = arch.tiny_model("nemotron_h")
    got, want = (arch.make_adapter(model, SpecConfig()) for _ in range(2))
    for adapter in (got, want):
        adapter.prefill([[5, 3, 8, 1], [2, 7]])
    got.mixers[2].S[1, 0, 0, 0] += 0.5
    found = compare_states(got, want, 1e-8, got_row=1, want_row=1)
    assert (found.layer, found.state, found.max_abs) == (4, "recurrent", pytest.approx(0.5, abs=1e-12))
    assert found.rel == pytest.approx(0.5 / want.mixers[2].S[1].abs().max().item(), rel=1e-12)
    assert compare_states(got, want, 1e-8) is None  # row 0 untouched


@pytest.mark.parametrize("plugin", available())
def test_every_installed_mixer_names_each_of_its_states(plugin):
    """What a diagnosis calls each state tensor of every tiny variant's mixers."""
    arch = get_plugin(plugin)
    known = {"recurrent", "conv window", "key cache", "value cache", "key/value cache", "cache length"}
    for variant in arch.tiny_variants:
        for m in arch.make_adapter(arch.tiny_model(variant), SpecConfig()).mixers:
            names = m.state_names()
            assert len(names) == len(m.state()) and set(names) <= known, (variant, type(m).__name__, names)
