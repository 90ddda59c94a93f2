"""Public API, plugin registry, configuration and CLI."""

import argparse
import functools
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pydantic
import numpy
import pytest
import torch

import specla
import specla.apps.cli
from specla import registry
from specla import SpecConfig, SpecDecoder, UnknownPluginError, UnsupportedModelError
from specla.apps.cli import main
from specla.drafters import EagleDrafter, NgramDrafter, make_drafter
from specla.registry import available, detect_plugin, get_plugin, plugin_infos
from specla_fla.oracle import naive_greedy_decode
from specla_fla.plugin import TINY_TARGET
from conftest import make_model

GDN = get_plugin("gdn")
TINY = TINY_TARGET  # the trained tiny target shipped with the plugin


def test_gdn_is_discovered_through_the_entry_point():
    assert "gdn" in available()
    info = {p.name: p for p in plugin_infos()}["gdn"]
    assert info.distribution == "specla" and info.version == specla.__version__
    assert info.model_types == ("gated_deltanet",)


def test_unknown_plugin_and_drafter_list_the_known_ones():
    with pytest.raises(UnknownPluginError, match=r"unknown plugin 'mamba9'; available plugins: .*gdn"):
        get_plugin("mamba9")
    with pytest.raises(UnknownPluginError, match=r"unknown drafter 'eagle9'; available drafters: ngram"):
        make_drafter("eagle9")
    with pytest.raises(UnknownPluginError, match=r"unknown drafter ''; available drafters: ngram"):
        make_drafter("")  # not the working directory
    with pytest.raises(UnknownPluginError, match="available plugins"):
        specla.run(make_model(), "nope", prompts=[[1]])


def test_plugin_autodetection_and_unsupported_models(tmp_path):
    model = make_model()
    assert detect_plugin(model).name == "gdn"
    assert detect_plugin(TINY).name == "gdn"
    result = specla.run(model, None, prompts=[[1, 2]], config=dict(max_new_tokens=4))
    assert result.outputs == [naive_greedy_decode(model, [1, 2], 4)]
    with pytest.raises(UnsupportedModelError, match="model_type None .Linear has no config.model_type"):
        detect_plugin(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="a model is a torch.nn.Module .* got NoneType"):
        specla.run(None, prompts=[[1]])
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(UnsupportedModelError, match="config.json has no model_type"):
        detect_plugin(tmp_path)
    with pytest.raises(UnsupportedModelError, match="tiny-eagle is a trained drafter .an EAGLE head., not a target"):
        SpecDecoder(TINY.parent / "tiny-eagle")
    assert SpecConfig(dtype=torch.bfloat16).dtype == "bfloat16"  # a torch.dtype is taken by name
    with pytest.raises(UnsupportedModelError,
                       match="runs fla.models.GatedDeltaNetForCausalLM, got torch.nn.modules.linear.Linear$"):
        specla.run(torch.nn.Linear(2, 2), "gdn", prompts=[[1]])
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    other = DeltaNetForCausalLM(DeltaNetConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="got fla.models.delta_net.modeling_delta_net.DeltaNetForCausalLM$"):
        SpecDecoder(other, "gdn")
    with pytest.raises(UnsupportedModelError, match="no plugin runs model_type 'delta_net'"):
        SpecDecoder(other, None)


def test_gdn_with_attention_residuals_is_rejected():
    # the plugin decides from the config alone
    model = make_model()
    model.config.attnres_block_size = 2
    with pytest.raises(UnsupportedModelError, match="attention residuals"):
        SpecDecoder(model, "gdn")


def test_config_validation():
    cfg = SpecConfig()
    assert (cfg.num_draft_tokens, cfg.engine.commit, cfg.temperature) == (8, "factor", 0.0)
    assert SpecConfig(temperature=0.7, top_p=0.9, sampling_top_k=20, seed=3).top_p == 0.9
    for bad in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"sampling_top_k": -1}):
        with pytest.raises(pydantic.ValidationError, match=next(iter(bad))):
            SpecConfig(**bad)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        SpecConfig(tempature=0.0)
    for field in ("num_draft_tokens", "max_depth", "top_k", "sampling_top_k", "max_new_tokens"):
        for bad in (True, "8", 8.0):  # no silent coercion of integer fields
            with pytest.raises(pydantic.ValidationError, match=f"{field}\n  Input should be a valid integer"):
                SpecConfig(**{field: bad, "temperature": 0.5})
        assert type(getattr(SpecConfig(**{field: numpy.int64(3), "temperature": 0.5}), field)) is int  # NumPy ints
        for bad in (numpy.array(8.0), numpy.array([8, 9])):  # a ValidationError, not operator.index's TypeError
            with pytest.raises(pydantic.ValidationError, match="Input should be a valid integer"):
                SpecConfig(**{field: bad, "temperature": 0.5})
    assert SpecConfig(temperature=1, seed=numpy.int64(3), stop_token_ids=(numpy.int64(3),)).seed == 3
    for field, bad in (("temperature", True), ("temperature", "0.8"), ("top_p", "0.9"), ("tau_tree", False)):
        with pytest.raises(pydantic.ValidationError, match=f"{field}\n  Value error, must be a number, got "
                                                            f"{type(bad).__name__} {bad!r}"):
            SpecConfig(**{"temperature": 0.5, field: bad})
    assert SpecConfig(tau_tree="inf", temperature=numpy.float32(0.5)).tau_tree == float("inf")
    for bad in ({"top_p": 0.5}, {"sampling_top_k": 5}):  # greedy decoding would ignore them
        with pytest.raises(pydantic.ValidationError, match="filter sampling: greedy decoding"):
            SpecConfig(**bad)
        assert SpecConfig(temperature=0.5, **bad).temperature == 0.5
    with pytest.raises(pydantic.ValidationError, match="commit"):
        SpecConfig(engine={"commit": "truncate"})
    with pytest.raises(pydantic.ValidationError, match="stop_token_ids must be non-negative"):
        SpecConfig(stop_token_ids=[-1])
    with pytest.raises(TypeError, match="config must be a SpecConfig"):
        specla.run(make_model(), "gdn", prompts=[[1]], config=3)


def test_prompt_type_errors():
    dec = SpecDecoder(make_model(), "gdn")
    with pytest.raises(TypeError, match="prompts must be a list"):
        dec.generate("hello")
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        dec.generate(["hello"])
    with pytest.raises(specla.InvalidTokenError, match="prompt 0 is empty"):
        dec.generate([[]])


def test_checkpoint_directory_with_tokenizer(tmp_path):
    model = make_model("expand_v2", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    result = specla.run(tmp_path, "gdn", prompts=[[5, 6, 7, 5, 6]], config=dict(max_new_tokens=6))
    assert result.outputs == [naive_greedy_decode(model, [5, 6, 7, 5, 6], 6)]
    assert result.texts is None
    # the bundled example carries its own tokenizer: strings in, text out
    dec = SpecDecoder(TINY, config=dict(max_new_tokens=5, dtype="float64"), plugin=None)
    out = dec.generate(["hello hello"])
    ids = dec.tokenizer("hello hello")["input_ids"]
    assert out.outputs == [naive_greedy_decode(dec.model, ids, 5)]
    assert out.texts == [dec.tokenizer.decode(out.outputs[0], skip_special_tokens=True)]
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        get_plugin("gdn").load_model(tmp_path / "missing", dtype=None, device=None)


def test_ngram_drafter_trees():
    d = NgramDrafter(max_ngram=2)
    ctx = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert d.continuations(ctx, 3) == [[4, 8, 1], [3, 9, 1]]
    chain = d.propose([ctx], SpecConfig(num_draft_tokens=8, max_depth=3, top_k=1))
    assert chain.tokens.tolist() == [[4, 8, 1]] and chain.parents.tolist() == [[-1, 0, 1]]
    tree = d.propose([ctx, [5, 6]], SpecConfig(num_draft_tokens=5, max_depth=3, top_k=2))
    assert tree.tokens[0].tolist() == [4, 8, 1, 3, 9] and tree.parents[0].tolist() == [-1, 0, 1, -1, 3]
    assert tree.num_nodes.tolist() == [5, 0]
    none = d.propose([ctx], SpecConfig(num_draft_tokens=0))
    assert none.width == 0


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specla.apps.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_plugins_and_generate():
    out = run_cli("plugins")
    assert out.returncode == 0 and "gdn" in out.stdout and "specla" in out.stdout
    out = run_cli("generate", "--model", str(TINY), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                  "--device", "cpu")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert 1 <= stats["generated_tokens"] <= 12 and stats["device"] == "cpu" and stats["plugin"] == "gdn"


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--model", "/nonexistent", "--prompt", "hi"], "--model /nonexistent does not exist"),
        (["generate", "--model", str(TINY / "config.json"), "--prompt", "hi"],
         f"--model {TINY / 'config.json'} is a file, not a checkpoint directory"),
        (["generate", "--model", str(TINY), "--prompt", "hi", "--max-new-tokens", "0"],
         "--max-new-tokens: Input should be greater than or equal to 1"),
        (["generate", "--model", str(TINY), "--prompt", "hi", "--plugin", "mamba9"], "unknown plugin 'mamba9'"),
        (["generate", "--model", str(TINY), "--prompt", "hi", "--drafter", "eagle9"], "unknown drafter"),
        (["generate", "--model", str(TINY), "--prompt", "", "--device", "cpu"], "the first --prompt is empty"),
        (["generate", "--model", str(TINY), "--prompt", "hi", "--device", "tpu"], "device 'tpu'"),
        (["demo", "--device", "tpu"], "--device: device 'tpu' is not a torch device"),
        (["generate", "--model", str(TINY), "--prompt", "hi", "--config", '{"bogus_key": 1}'],
         "--config bogus_key: unknown option"),
    ],
)
def test_cli_errors_are_one_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("specla: error:") and message in last
    assert "Traceback" not in out.stderr


def test_demo_is_exact_and_reports_figures():
    from specla.apps.demo import run_demo

    lines = []
    summary = run_demo(device="cpu", max_new_tokens=24, echo=lines.append)
    assert summary["exact_match"] is True
    assert summary["prompts"] == 6 and sum(line.startswith("=== ") for line in lines) == 6
    assert lines[0] == ("target: the qwen plugin's demo model, Qwen3_5ForCausalLM with 8M parameters, trained for "
                        "minutes on a small corpus: its text loops; what the demo shows is exact_match (speculative "
                        "tokens equal plain decoding's) and the speedup, in the JSON line at the end")
    assert summary["mean_accepted_tokens"] > 0 and summary["speedup"] > 0
    assert summary["speedup"] == pytest.approx(summary["tokens_per_s"] / summary["ar_tokens_per_s"])


def test_demo_refuses_an_unknown_drafter_before_loading_anything(monkeypatch):
    """``specla demo --drafter bogus`` names the choices (the shipped ``eagle`` included) and
    fails before the target loads (nothing is decoded, no progress bar is left open)."""
    import specla.apps.demo

    monkeypatch.setattr(specla.apps.demo, "SpecDecoder", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(specla.UnknownPluginError, match=r"unknown demo drafter 'bogus': use ngram, eagle or a "
                                                        r"directory saved by `specla train-drafter`"):
        specla.apps.demo.run_demo(device="cpu", drafter="bogus")


def test_input_robustness():
    model = make_model()
    with pytest.raises(specla.InvalidTokenError, match="no prompts given"):
        specla.run(model, "gdn", prompts=[])
    with pytest.raises(specla.TokenTypeError, match="position 1: token ids must be integers, got float 2.9"):
        specla.run(model, "gdn", prompts=[[5, 2.9]])
    with pytest.raises(specla.TokenTypeError, match="got bool True"):
        specla.run(model, "gdn", prompts=[[5, True]])
    # tensors and arrays are accepted as token-id rows
    out = specla.run(model, "gdn", prompts=[torch.tensor([5, 6, 7])], config=dict(max_new_tokens=3))
    assert out.outputs == [naive_greedy_decode(model, [5, 6, 7], 3)]
    with pytest.raises(FileNotFoundError, match="tokenizer directory /nonexistent"):
        SpecDecoder(model, "gdn", tokenizer="/nonexistent")
    with pytest.raises(pydantic.ValidationError, match="not a torch device"):
        SpecConfig(device="tpu0x")
    # "cpu:0" is the CPU: trees and the model must agree on it
    out = specla.run(model, "gdn", prompts=[[5, 6, 5, 6, 5]], config=dict(device="cpu:0", max_new_tokens=4))
    assert out.outputs == [naive_greedy_decode(model, [5, 6, 5, 6, 5], 4)]


def test_max_new_tokens_caps_the_drafts_and_eos_stops():
    model = make_model()
    motif = [32, 52, 28, 56]
    r = specla.run(model, "gdn", prompts=[motif * 5], config=dict(max_new_tokens=1))
    assert r.stats.mean_accepted_tokens == 0 and r.outputs == [naive_greedy_decode(model, motif * 5, 1)]
    ref = naive_greedy_decode(model, motif * 5, 12)
    model.config.eos_token_id = ref[4]
    r = specla.run(model, "gdn", prompts=[motif * 5], config=dict(max_new_tokens=12))
    assert r.outputs == [ref[: ref.index(ref[4]) + 1]]
    r = specla.run(model, "gdn", prompts=[motif * 5], config=dict(max_new_tokens=12, stop_at_eos=False))
    assert r.outputs == [ref]


def test_unsupported_checkpoint_rejected_before_loading(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attnres_block_size"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="attention residuals"):
        SpecDecoder(tmp_path, "gdn")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        SpecDecoder(tmp_path, "gdn")


def test_half_precision_checkpoints_run_in_float32_on_cpu_and_config_json_roundtrips():
    dec = SpecDecoder(TINY, None)  # stored in bfloat16; loaded by specla, so converted once, in place
    assert dec.model.lm_head.weight.dtype == torch.float32 and dec.adapter.dtype == torch.float32
    model = specla.registry.get_plugin("gdn").load_model(TINY, dtype=None, device=None)
    assert SpecDecoder(model).adapter.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16  # a caller's model is never converted
    assert SpecDecoder(TINY, None, config=dict(dtype="bfloat16")).adapter.dtype == torch.bfloat16
    dumped = json.loads(json.dumps(SpecConfig().model_dump(mode="json")))  # strict JSON: no Infinity
    assert dumped["tau_tree"] == "inf" and SpecConfig.model_validate(dumped) == SpecConfig()


@pytest.mark.parametrize("drafter,error", [("medusa", "UnknownPluginError"), ("mtp", "DrafterError"),
                                           ("./no/such/dir", "DrafterError")])
def test_a_wrong_drafter_fails_before_the_checkpoint_loads(monkeypatch, drafter, error):
    """A drafter name no plugin knows, a model's own drafter the checkpoint's plugin lacks, a
    missing directory: each refused by name before any weight is read."""
    plugin = get_plugin("gdn")
    monkeypatch.setattr(type(plugin), "load_model", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    with pytest.raises(specla.SpecError) as err:
        SpecDecoder(TINY, drafter=drafter)
    assert type(err.value).__name__ == error


# -- plugins that fail to load, and plugins that disagree (fake distributions on sys.path) ------------

def reload_registry():
    registry.plugin_manager.cache_clear()
    registry._architectures.cache_clear()


@pytest.fixture
def install(tmp_path, monkeypatch):
    """``install(dist, version, entry_point=module_source, ...)`` installs a fake distribution for
    one test: each module, and a ``dist-info`` folder naming them in the ``specla.plugins`` group,
    in a folder put on ``sys.path``; the registry is reloaded then. The test runs on caches of its
    own, so the process's registry, with the very plugin objects other test modules hold, comes
    back after it."""
    for cached in ("plugin_manager", "_architectures"):
        monkeypatch.setattr(registry, cached, functools.lru_cache(maxsize=1)(getattr(registry, cached).__wrapped__))
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = []

    def install(dist: str, version: str, **plugins: str) -> None:
        stem = dist.replace("-", "_")
        for ep, source in plugins.items():
            (tmp_path / f"{stem}_{ep}.py").write_text(source)
            modules.append(f"{stem}_{ep}")
        info = tmp_path / f"{stem}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{ep} = {stem}_{ep}\n" for ep in plugins)
        (info / "entry_points.txt").write_text(f"[specla.plugins]\n{lines}")
        importlib.invalidate_caches()
        reload_registry()

    yield install
    for module in modules:
        sys.modules.pop(module, None)


HOOK = "import sys\nfrom specla.hookspecs import hookimpl\n\n@hookimpl\ndef specla_architectures():\n    {}\n"


def gdn_fork(name: str, model_types: tuple[str, ...], claims: str = "True") -> str:
    """A plugin module registering the GDN plugin again as ``name`` for ``model_types``."""
    return ("from specla.hookspecs import hookimpl\nfrom specla_fla.plugin import GDNPlugin\n\n"
            f"class Fork(GDNPlugin):\n    name = {name!r}\n    model_types = {model_types!r}\n"
            f"    def claims(self, model):\n        return {claims}\n\n"
            "@hookimpl\ndef specla_architectures():\n    return [Fork()]\n")


BROKEN = [
    ("import no_such_module_for_specla\n", "ModuleNotFoundError: No module named 'no_such_module_for_specla'"),
    ("def f(:\n", "SyntaxError: invalid syntax (broken_dist_bad.py, line 1)"),
    ("raise RuntimeError('no GPU found')\n", "RuntimeError: no GPU found"),
    ("import sys\nsys.exit('cannot start')\n", "SystemExit: cannot start"),
    (HOOK.format("raise ValueError('bad config\\nsecond line')"),
     "specla_architectures() raised ValueError: bad config"),
    (HOOK.format("sys.exit(3)"), "specla_architectures() raised SystemExit: 3"),
    (HOOK.format("return None"),
     "specla_architectures() returned NoneType, not a list of ArchitecturePlugin instances"),
    (HOOK.format("return 7"), "specla_architectures() returned int, not a list of ArchitecturePlugin instances"),
    (HOOK.format("return ['gdn']"),
     "specla_architectures() returned a str in its list, not an ArchitecturePlugin instance"),
    (HOOK.format("from specla_fla.plugin import GDNPlugin\n"
                 "    return [type('Nameless', (GDNPlugin,), {'name': ''})()]"),
     "Nameless.name is '', not a non-empty string"),
    ("def specla_architectures():\n    return []\n",
     "it implements no specla_architectures hook (marked with specla.hookspecs.hookimpl)"),
]


@pytest.mark.parametrize("source, error", BROKEN, ids=[
    "import-error", "syntax-error", "exception", "sys-exit", "hook-raises", "hook-exits", "hook-none",
    "hook-not-iterable", "hook-not-plugins", "hook-unnamed-plugin", "no-hook"])
def test_a_plugin_that_fails_to_load_is_skipped_with_a_warning_naming_it(install, capsys, source, error):
    install("broken-dist", "2.5", bad=source)
    with pytest.warns(specla.PluginLoadWarning) as caught:
        names = available()
    assert [str(w.message) for w in caught] == [
        f"specla plugin 'bad' (entry point 'bad' of broken-dist 2.5) is skipped: {error}"]
    assert {"gdn", "gla", "mamba2", "qwen", "retention"} <= set(names) and "bad" not in names
    assert get_plugin("gdn").name == "gdn" and detect_plugin(TINY).name == "gdn"
    with pytest.raises(UnknownPluginError) as err:
        get_plugin("bad")
    assert str(err.value) == f"plugin 'bad' (broken-dist 2.5) failed to load: {error}"
    assert specla.apps.cli.main(["plugins"]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith("name ") and "\ngdn " in listing
    assert listing.endswith(f"\n\nfailed to load (skipped):\n"
                            f"bad           broken-dist              2.5        {error}\n")


def test_models_still_run_beside_broken_plugins_and_naming_one_is_a_one_line_error(install, capsys):
    install("broken-dist", "2.5", bad=BROKEN[0][0], worse=HOOK.format("return None"))
    with pytest.warns(specla.PluginLoadWarning):
        dec = SpecDecoder(TINY, config=dict(max_new_tokens=5, dtype="float64"))
    assert dec.plugin.name == "gdn"
    out = dec.generate([[5, 6, 7]])
    assert out.outputs == [naive_greedy_decode(dec.model, [5, 6, 7], 5)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        specla.apps.cli.main(["generate", "--model", str(TINY), "--prompt", "hi", "--plugin", "worse"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("specla: error: plugin 'worse' (broken-dist 2.5) failed to load: "
                                       "specla_architectures() returned NoneType, not a list of ArchitecturePlugin "
                                       "instances\n")


def test_a_third_party_plugin_claiming_a_built_in_model_type_is_used_by_name_only(install, capsys):
    install("gdn-fork", "0.3", fork=gdn_fork("gdnfork", ("gated_deltanet",)))
    with pytest.warns(specla.PluginConflictWarning) as caught:
        assert detect_plugin(TINY).name == "gdn"
    assert [str(w.message) for w in caught] == [
        "specla plugin 'gdnfork' (gdn-fork 0.3) declares model_type 'gated_deltanet', which the built-in plugin "
        "'gdn' runs: auto-detection picks the built-in one; pass plugin='gdnfork' (--plugin gdnfork) to use 'gdnfork'"]
    assert detect_plugin(make_model()).name == "gdn"
    assert SpecDecoder(TINY).plugin.name == "gdn"
    assert SpecDecoder(TINY, "gdnfork").plugin.name == "gdnfork"
    assert {p.name: p.notes for p in plugin_infos()}["gdnfork"] == (
        "gated_deltanet: auto-detection picks gdn (built-in)",)
    assert specla.apps.cli.main(["plugins"]) == 0
    assert ("\ngdnfork       gdn-fork                 0.3        gated_deltanet  (gated_deltanet: auto-detection "
            "picks gdn (built-in))\n") in capsys.readouterr().out


AMBIGUOUS = ("the plugins 'forka' (fork-a 1.0) and 'forkb' (fork-b 2.0) all run model_type 'fork_type' and their "
             "claims() do not single one out for this model: pass plugin= (the CLI's --plugin) naming one")


@pytest.mark.parametrize("claims_a, claims_b, picked", [("True", "True", AMBIGUOUS), ("False", "False", AMBIGUOUS),
                                                        ("False", "True", "forkb"), ("True", "False", "forka")])
def test_third_party_plugins_sharing_a_model_type_need_claims_or_a_name(install, tmp_path, claims_a, claims_b, picked):
    install("fork-a", "1.0", forka=gdn_fork("forka", ("fork_type",), claims_a))
    install("fork-b", "2.0", forkb=gdn_fork("forkb", ("fork_type",), claims_b))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "fork_type"}')
    if picked == AMBIGUOUS:
        with pytest.raises(UnsupportedModelError) as err:
            detect_plugin(checkpoint)
        assert str(err.value) == AMBIGUOUS
    else:
        assert detect_plugin(checkpoint).name == picked
    assert get_plugin("forka").name == "forka" and get_plugin("forkb").name == "forkb"
    assert {p.name: p.notes for p in plugin_infos()}["forka"] == ("fork_type: shared with forkb; claims() decides",)


def test_a_taken_architecture_or_entry_point_name_skips_the_later_plugin_only(install, capsys):
    install("twin-dist", "1.1", atwin=gdn_fork("twin", ("twin_type",)), btwin=gdn_fork("twin", ("other_type",)),
            fakegdn=gdn_fork("gdn", ("twin_type",)))
    install("clash-dist", "1.0", gdn=gdn_fork("gdn2", ("twin_type",)))
    with pytest.warns(specla.PluginLoadWarning) as caught:
        names = available()
    assert [str(w.message) for w in caught] == [
        "specla plugin 'gdn' (entry point 'gdn' of clash-dist 1.0) is skipped: the entry point name is taken by "
        "specla 0.1.0",
        "specla plugin 'twin' (entry point 'btwin' of twin-dist 1.1) is skipped: the architecture name 'twin' is "
        "taken by twin-dist 1.1",
        "specla plugin 'gdn' (entry point 'fakegdn' of twin-dist 1.1) is skipped: the architecture name 'gdn' is "
        "taken by specla 0.1.0"]
    assert "twin" in names and "gdn2" not in names and get_plugin("twin").model_types == ("twin_type",)
    assert type(get_plugin("gdn")).__module__ == "specla_fla.plugin"
    assert specla.apps.cli.main(["plugins"]) == 0
    assert capsys.readouterr().out.endswith(
        "failed to load (skipped):\n"
        "gdn           clash-dist               1.0        the entry point name is taken by specla 0.1.0\n"
        "twin          twin-dist                1.1        the architecture name 'twin' is taken by twin-dist 1.1\n"
        "gdn           twin-dist                1.1        the architecture name 'gdn' is taken by specla 0.1.0\n")


def test_the_demo_runs_the_built_in_checkpoint_beside_a_third_party_plugin_that_ships_one(install):
    from specla.apps.demo import default_checkpoint

    demo = "from specla_fla.plugin import TINY_TARGET\nFork.demo_checkpoint = TINY_TARGET\n"
    install("gdn-fork", "0.3", fork=gdn_fork("agdn", ("agdn_type",)) + demo)  # sorts before qwen
    assert get_plugin("agdn").demo_checkpoint == TINY
    assert default_checkpoint() == ("qwen", get_plugin("qwen").demo_checkpoint)

def test_the_fake_distributions_leave_the_process_registry_as_it_was():
    """``install`` ran in earlier tests of this module: the plugin objects held since import are
    still the registered ones (test_mamba2_hybrid compares them by identity)."""
    assert get_plugin("gdn") is GDN
    assert "agdn" not in available() and registry.failed_plugins() == []
def test_a_folder_never_shadows_a_drafter_name(tmp_path, monkeypatch, capsys):
    """``"ngram"`` is the n-gram drafter beside an empty folder ``ngram/`` and beside a trained
    drafter copied there (``"./ngram"`` is that folder), in the API, ``specla generate`` and
    ``specla demo``; ``"mtp"`` is never a folder; a bare string naming no drafter still names a
    directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ngram").mkdir()
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    with pytest.raises(specla.DrafterError, match=r"^\./ngram is not a trained drafter directory$"):
        make_drafter("./ngram")
    assert isinstance(SpecDecoder(TINY, drafter="ngram").drafter, NgramDrafter)
    assert main(["generate", "--model", str(TINY), "--prompt", "hi", "--max-new-tokens", "2",
                            "--device", "cpu", "--drafter", "ngram"]) == 0
    capsys.readouterr()
    eagle = TINY.parent / "tiny-eagle"
    for folder in ("ngram", "mtp", "my-drafter"):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(eagle, folder)
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    assert isinstance(make_drafter("./ngram"), EagleDrafter)
    assert isinstance(make_drafter(tmp_path / "ngram"), EagleDrafter)
    assert isinstance(make_drafter("my-drafter"), EagleDrafter)
    with pytest.raises(specla.DrafterError, match=r"^drafter 'mtp' is a model's own drafter \(the mamba2_hybrid, qwen "
                                                  r"plugins' models bring it\): pass it to SpecDecoder with such a "
                                                  r"model$"):
        make_drafter("mtp")
    assert isinstance(make_drafter("./mtp"), EagleDrafter)
    from specla.apps import demo

    class Built(Exception):
        """The demo's drafter, raised where the demo would load its target."""

    def built(*args, drafter, **kwargs):
        raise Built(drafter)

    monkeypatch.setattr(demo, "SpecDecoder", built)
    for name, kind in (("ngram", NgramDrafter), ("./ngram", EagleDrafter)):
        with pytest.raises(Built) as got:
            demo.run_demo(device="cpu", drafter=name, progress=False)
        assert isinstance(got.value.args[0], kind)


def _edited_checkpoint(directory, layers=None, tensors=None):
    """A copy of TINY in ``directory`` with ``num_hidden_layers`` set to ``layers`` and its weights
    passed through ``tensors`` (a function of the state dict)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY, directory)
    if layers is not None:
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=layers)))
    if tensors is not None:
        weights = load_file(directory / "model.safetensors")
        save_file(tensors(weights), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _renamed(weights):
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    return weights


def _cut(weights):
    weights["model.norm.weight"] = weights["model.norm.weight"][:255].clone()
    return weights


LAYER_6 = "model.layers.6.attn.A_log, model.layers.6.attn.a_proj.weight, model.layers.6.attn.b_proj.weight, ..."


@pytest.mark.parametrize("layers, tensors, problems", [
    (7, None, f"18 missing from the files ({LAYER_6})"),
    (5, None, f"18 in the files but not in the model ({LAYER_6.replace('.6.', '.5.')})"),
    (None, _renamed, "1 missing from the files (model.norm.weight); 1 in the files but not in the model "
                     "(model.final_norm.weight)"),
    (None, _cut, "1 of another shape (model.norm.weight: [255] in the files, [256] in the model)"),
], ids=["more-layers", "fewer-layers", "renamed", "reshaped"])
def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_refused(tmp_path, capsys, layers, tensors, problems):
    """``num_hidden_layers`` above or below the layers the weights hold, a renamed tensor, a tensor of
    another shape: the API and ``specla generate`` refuse the directory by name and list the weights
    (transformers would fill the gaps with random weights and drop the rest); the unedited copy
    (tied LM head, bfloat16) loads."""
    path = _edited_checkpoint(tmp_path / "ckpt", layers, tensors)
    message = (f"{path}: its weights do not fit its config.json (the model would run on random or dropped "
               f"weights): {problems}")
    with pytest.raises(UnsupportedModelError) as err:
        SpecDecoder(path)
    assert str(err.value) == message
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.strip().splitlines()[-1] == f"specla: error: {message}"
    assert "Traceback" not in stderr
    assert isinstance(SpecDecoder(_edited_checkpoint(tmp_path / "unedited")).model, torch.nn.Module)


def test_a_checkpoint_whose_config_lacks_the_model_sizes_is_refused_before_the_model_is_built(tmp_path, capsys,
                                                                                              monkeypatch):
    """A config.json of ``{"model_type": "qwen3_5_text"}`` alone describes the class's default
    model (billions of parameters) beside 8M parameters of weights: refused from the safetensors
    headers and a model on the meta device, by the API and ``specla generate``, with both counts,
    and transformers' ``from_pretrained`` (which would build the default model in full) never
    runs."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tmp_path / "ckpt"
    shutil.copytree(get_plugin("qwen").demo_checkpoint, path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    held = sum(t.numel() for t in load_file(path / "model.safetensors").values())

    def never(*args, **kwargs):
        raise AssertionError("from_pretrained ran")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    pattern = (rf"^{re.escape(str(path))}: its config.json describes a model of (\d+\.\d)M parameters, its weight "
               rf"files hold {re.escape(f'{held / 1e6:.1f}')}M: the model would run on random weights \(a "
               r"config.json missing the model's sizes\?\)$")
    with pytest.raises(UnsupportedModelError) as err:
        SpecDecoder(path)
    needed = re.match(pattern, str(err.value))
    assert needed, str(err.value)
    assert float(needed[1]) > 248320 * 4096 / 1e6  # at least the default vocabulary's embedding
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(path), "--prompt", "hi", "--device", "cpu"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and stderr.strip().splitlines()[-1] == f"specla: error: {err.value}"


def test_max_new_tokens_is_at_most_a_32_bit_integer(capsys):
    """``max_new_tokens`` beyond 2**31 - 1 is refused by the config (from 2**63 on it would
    overflow inside a step), from the API and from ``--max-new-tokens`` in one line, before loading."""
    assert SpecConfig(max_new_tokens=2**31 - 1).max_new_tokens == 2**31 - 1
    with pytest.raises(pydantic.ValidationError, match="max_new_tokens\n  Input should be less than or equal to "
                                                       "2147483647"):
        SpecConfig(max_new_tokens=10**30)
    with pytest.raises(SystemExit) as exit_:
        specla.apps.cli.main(["generate", "--model", str(TINY), "--prompt", "hi", "--max-new-tokens", str(10**30),
                         "--device", "cpu"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("specla: error: --max-new-tokens: Input should be less than or equal to "
                                       "2147483647\n")


def test_a_model_on_the_meta_device_is_refused_before_anything_else():
    model = make_model()
    total = len(list(model.parameters())) + len(list(model.buffers()))
    with torch.device("meta"):
        empty = type(model)(model.config)
    with pytest.raises(UnsupportedModelError, match=rf"^{total} of the model's {total} weights are on the meta "
                                                    r"device: load them first \(model.embeddings.weight, "
                                                    r"model.layers.0.attn_norm.weight, model.layers.0.attn.A_log, "
                                                    r"\.\.\.\)$"):
        SpecDecoder(empty, "nonexistent-plugin")  # refused before the plugin is looked up
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    with pytest.raises(UnsupportedModelError, match=rf"^1 of the model's {total} weights are on the meta device: "
                                                    r"load them first \(lm_head.weight\)$"):
        SpecDecoder(model)


def test_string_prompts_that_are_not_unicode_text_are_refused():
    """A lone surrogate (what bytes that are not UTF-8 become in ``sys.argv``) in a string prompt
    is an InvalidTokenError naming the prompt, not the tokenizer's TypeError."""
    dec = SpecDecoder(TINY, config=dict(device="cpu", max_new_tokens=2))
    with pytest.raises(specla.InvalidTokenError, match=r"^prompt 1 is not valid text: 'utf-8' codec can't encode "
                                                       r"characters in position 2-3: surrogates not allowed$"):
        dec.generate(["hi", "ab\udcff\udcfe"])


def test_cli_refuses_a_prompt_that_is_not_utf8_before_loading():
    """Bytes that are not UTF-8 in ``--prompt`` (a real argv, through a subprocess): one line
    naming the flag and the byte, exit 2, and torch never imported."""
    script = ("import sys, specla.apps.cli\n"
              "try:\n    specla.apps.cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
              "    print(e.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script, "generate", "--model", str(TINY).encode(), "--prompt", "ok",
                          "--prompt", b"ab\xff\xfe"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LC_ALL": "C.UTF-8"})
    assert out.stdout == "2 False\n"
    assert out.stderr == ("specla: error: the second --prompt is not UTF-8 text ('utf-8' codec can't decode byte "
                          "0xff in position 2: invalid start byte)\n")


def test_cli_reads_utf8_bytes_that_argv_escaped_as_text():
    """Where the locale did not decode UTF-8 (argv then holds each byte as a lone surrogate), the
    bytes are read as UTF-8: ``café`` reaches the tokenizer, not ``caf\\udcc3\\udca9``."""
    args = argparse.Namespace(prompt=["caf\udcc3\udca9", "tea"])
    assert specla.apps.cli._prompts(args) == ["café", "tea"]


@pytest.mark.parametrize("flags, message", [
    (["--prompt", ""], "the first --prompt is empty: give the text to continue"),
    (["--prompt", "def f():", "--prompt", " \n\t"],
     "the second --prompt is empty (only whitespace): give the text to continue"),
    (["--prompt", "hi", "--stop", "\udcff"], "the first --stop is not UTF-8 text ('utf-8' codec can't decode byte "
                                             "0xff in position 0: invalid start byte)"),
])
def test_cli_refuses_an_empty_prompt_or_a_stop_that_is_not_text_before_loading(monkeypatch, capsys, flags, message):
    import specla.api

    monkeypatch.setattr(specla.api, "SpecDecoder", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["generate", "--model", str(TINY), "--device", "cpu", *flags]
    with pytest.raises(SystemExit) as exit_:
        specla.apps.cli.main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == f"specla: error: {message}\n"


def test_version_and_argument_errors_answer_without_importing_torch():
    """``specla --version`` prints the installed version; argument errors (argparse's and an
    empty prompt) exit 2; none of them imports torch or the plugins (seconds each)."""
    from importlib.metadata import version

    script = ("import json, sys, specla.apps.cli\ncodes = []\n"
              f"for argv in (['--version'], ['generate', '--bogus'], ['generate', '--model', {str(TINY)!r}, "
              "'--prompt', '']):\n"
              "    try:\n        specla.apps.cli.main(argv)\n"
              "    except SystemExit as e:\n        codes.append(e.code)\n"
              "print(json.dumps([codes, 'torch' in sys.modules, 'specla.registry' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout.splitlines()[-1]) == [[0, 2, 2], False, False], out.stderr
    assert out.stdout.splitlines()[0] == f"specla {version('specla')}"
    assert "unrecognized arguments: --bogus" in out.stderr or "required: --model, --prompt" in out.stderr


@pytest.mark.parametrize("cuda_graphs", ["off", "unrecorded"])
def test_progress_callback_and_an_interrupt_that_leaves_the_decoder_usable(cuda_graphs):
    """``generate(progress=f)`` calls ``f`` after every step with the counts so far; a
    KeyboardInterrupt it raises becomes a GenerationInterrupted carrying the tokens accepted by
    then (prefixes of the whole run's), and the next call decodes as a fresh decoder does."""
    prompts = [[5, 6, 7, 5, 6], [9, 3, 9, 3, 9, 3, 9]]
    config = dict(max_new_tokens=20, num_draft_tokens=4, max_depth=4,
                  engine=dict(cuda_graphs=cuda_graphs, budget_policy="fixed"))
    full = SpecDecoder(make_model(), "gdn", config=config).generate(prompts)
    dec = SpecDecoder(make_model(), "gdn", config=config)
    seen = []
    result = dec.generate(prompts, progress=lambda s: seen.append((s.steps, s.generated_tokens)))
    assert result.outputs == full.outputs
    assert [s for s, _ in seen] == list(range(1, result.stats.steps + 1)) and result.stats.steps > 2
    assert seen[-1][1] == result.stats.generated_tokens == 40

    def interrupt(stats):
        if stats.steps == 2:
            raise KeyboardInterrupt

    with pytest.raises(specla.GenerationInterrupted, match=r"^generation interrupted after \d+ generated tokens$") \
            as stopped:
        dec.generate(prompts, progress=interrupt)
    err = stopped.value
    assert isinstance(err, KeyboardInterrupt) and err.stats.steps == 2 and err.texts is None
    assert err.stats.generated_tokens == sum(map(len, err.outputs)) == seen[1][1]
    assert all(0 < len(o) < 20 and f[: len(o)] == o for o, f in zip(err.outputs, full.outputs))
    assert dec.generate(prompts).outputs == full.outputs
    with pytest.raises(TypeError, match="progress must be a bool or a callable, got str"):
        dec.generate(prompts, progress="yes")


def test_progress_true_shows_a_bar_of_tokens_on_stderr(capsys):
    dec = SpecDecoder(make_model(), "gdn", config=dict(max_new_tokens=6))
    dec.generate([[5, 6, 7]], progress=True)
    err = capsys.readouterr().err
    assert "generate:   0%|          | 0/6 [00:00<?, ?tok/s]" in err
    dec.generate([[5, 6, 7]])
    assert capsys.readouterr().err == ""


def test_a_run_past_the_trained_context_warns_once(recwarn):
    model = make_model()
    model.config.max_position_embeddings = 8
    dec = SpecDecoder(model, "gdn", config=dict(max_new_tokens=4))
    dec.generate([[5, 6, 7, 5], [1, 2, 3, 4, 5]])
    assert [str(w.message) for w in recwarn if w.category is specla.ContextLengthWarning] == [
        "the longest prompt (5 tokens) + max_new_tokens (4) exceeds the model's trained context "
        "(max_position_embeddings 8): decoding goes on past it, but the quality of the tokens beyond it is unknown"]
    assert recwarn[0].filename == __file__  # points at the caller's generate
    recwarn.clear()
    dec.generate([[5, 6, 7, 5]])  # 4 + 4 = 8: within it
    assert not [w for w in recwarn if w.category is specla.ContextLengthWarning]


def test_sigint_during_a_long_generate_prints_what_was_decoded():
    """A real Ctrl-C (SIGINT) once the progress bar shows tokens: exit 130, the partial text and
    its statistics on stdout, one line on stderr, no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "specla.apps.cli", "generate", "--model", str(TINY), "--prompt",
                             "def add(a, b):", "--max-new-tokens", "100000000", "--device", "cpu", "--progress",
                             "--config", '{"stop_at_eos": false}'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err, started = bytearray(), threading.Event()

    def read():
        while chunk := proc.stderr.read1(4096):
            err.extend(chunk)
            if re.search(rb"generate: [^\r]*\| [1-9][0-9]*/100000000", err):  # the bar has counted tokens
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 240
    while not started.wait(0.5) and reader.is_alive() and time.monotonic() < deadline:
        pass
    assert started.is_set(), err.decode()
    proc.send_signal(signal.SIGINT)
    out = proc.stdout.read().decode()
    assert proc.wait(60) == 130
    reader.join()
    stats = json.loads(out.splitlines()[-1])
    assert 0 < stats["generated_tokens"] < 100000000 and out.splitlines()[-2] == "-" * 40
    last = err.decode().splitlines()[-1].split("\r")[-1]
    assert last == ("specla: interrupted: the output above is what was decoded until then "
                    f"({stats['generated_tokens']} tokens)") and "Traceback" not in err.decode()


def test_bad_options_given_as_a_dict_are_a_config_error_naming_each_field():
    """``config={...}`` errors are specla's ``ConfigError`` (a ``SpecError`` and a ``ValueError``),
    naming every bad field, before anything loads; ``SpecConfig(...)`` itself keeps pydantic's
    ``ValidationError``."""
    from specla import ConfigError

    with pytest.raises(ConfigError) as err:
        SpecDecoder("no/such/dir", config={"max_new_tokens": -1, "temperature": -0.5, "tempature": 1})
    assert str(err.value) == ("config: temperature: Input should be greater than or equal to 0; max_new_tokens: "
                              "Input should be greater than or equal to 1; tempature: unknown option")
    assert isinstance(err.value, specla.SpecError) and isinstance(err.value, ValueError)
    with pytest.raises(ConfigError, match=r"^config: max_new_tokens: Input should be greater than or equal to 1$"):
        specla.run(TINY, prompts=[[1, 2]], config={"max_new_tokens": 0})
    with pytest.raises(ConfigError) as err:  # what a validator said, without pydantic's "Value error, "
        SpecDecoder("no/such/dir", config={"stop_token_ids": [-1]})
    assert str(err.value) == "config: stop_token_ids: stop_token_ids must be non-negative token ids, got (-1,)"
    with pytest.raises(ConfigError) as err:  # a check of the whole config: named once
        SpecDecoder("no/such/dir", config={"top_p": 0.5})
    assert str(err.value).startswith("config: top_p (0.5) and sampling_top_k (0) filter sampling: ")
