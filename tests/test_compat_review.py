"""Compatibility with how checkpoints and libraries are found in the wild: end-of-sequence ids as
transformers' ``generate`` reads them (a list; the generation config first), the test run's
Triton mode on CUDA and CPU machines, and the e2e benchmark's transformers ``generate`` row
(checked against the AR row, library versions recorded)."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specla
from specla import SpecDecoder
from specla.errors import UnsupportedModelError
from specla.layerwise import eos_token_ids
from specla.registry import get_plugin

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TREE = dict(num_draft_tokens=6, max_depth=4, top_k=2)


def first_new(ref: list[int], start: int) -> int:
    """The first index ``k >= start`` whose token does not occur in ``ref[:k]``."""
    return next(k for k in range(start, len(ref)) if ref[k] not in ref[:k])


# ------------------------------------------------------------------ end-of-sequence ids


def fake_model(config_eos, generation_eos="unset"):
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=config_eos))
    if generation_eos != "unset":
        model.generation_config = SimpleNamespace(eos_token_id=generation_eos)
    return model


@pytest.mark.parametrize("config_eos, generation_eos, expected", [
    (2, "unset", (2,)),
    ([5, 2, 5], "unset", (5, 2)),            # order kept, repeats dropped
    ((7,), "unset", (7,)),
    (None, "unset", ()),
    (None, None, ()),
    (2, None, (2,)),                         # a generation config without eos: the config's
    (2, [9, 4], (9, 4)),                     # the generation config's first, as generate does
    (None, 3, (3,)),
    (np.int64(6), "unset", (6,)),
    (torch.tensor([8, 1]), "unset", (8, 1)),
])
def test_eos_token_ids_are_read_as_transformers_generate_reads_them(config_eos, generation_eos, expected):
    got = eos_token_ids(fake_model(config_eos, generation_eos))
    assert got == expected and all(type(t) is int for t in got)


def test_eos_token_ids_without_config_and_with_bad_ids():
    assert eos_token_ids(torch.nn.Linear(2, 2)) == ()  # a module with neither attribute
    with pytest.raises(UnsupportedModelError, match=r"config.eos_token_id must be an int or a list of ints, got '2'"):
        eos_token_ids(fake_model("2"))
    with pytest.raises(UnsupportedModelError, match=r"generation_config.eos_token_id .* got \[1, True\]"):
        eos_token_ids(fake_model(2, [1, True]))
    with pytest.raises(UnsupportedModelError, match="got 2.0"):
        eos_token_ids(fake_model(2.0))


@pytest.mark.parametrize("plugin", ["gdn", "gla", "mamba2"])
def test_a_list_of_eos_ids_stops_at_any_of_them(plugin):
    """``config.eos_token_id = [never emitted, the greedy token of step k]``: speculative (tree)
    and autoregressive runs stop right after step ``k``, equal to the plugin's reference decoder
    cut there; the adapter exposes both ids."""
    p = get_plugin(plugin)
    model = p.tiny_model(next(iter(p.tiny_variants)), seed=0, dtype=torch.float32)
    V = model.get_input_embeddings().weight.shape[0]
    prompt = [3, 11, 7, 3, 11, 7, 3, 11]
    ref = p.reference_decode(model, prompt, 16)
    k = first_new(ref, 3)
    never = next(t for t in range(V) if t not in ref)
    model.config.eos_token_id = [never, ref[k]]
    for n_draft in (TREE, dict(num_draft_tokens=0)):
        dec = SpecDecoder(model, plugin, config=dict(max_new_tokens=16, dtype="float32", **n_draft))
        assert dec.adapter.eos_token_ids == (never, ref[k])
        assert dec.generate([prompt]).outputs == [ref[: k + 1]]
    r = specla.run(model, plugin, prompts=[prompt], config=dict(max_new_tokens=16, stop_at_eos=False, **TREE))
    assert r.outputs == [ref]


def test_the_generation_configs_eos_ids_take_precedence(tmp_path):
    """``config.eos_token_id`` says step ``k1``, ``generation_config.eos_token_id`` (a list) says
    step ``k2 > k1``: generation stops after ``k2``, for a loaded model and for a checkpoint
    directory whose ``generation_config.json`` transformers reads."""
    p = get_plugin("gdn")
    model = p.tiny_model("base", seed=0, dtype=torch.float32)
    prompt = [5, 9, 14, 5, 9, 14, 5]
    ref = p.reference_decode(model, prompt, 16)
    k1 = first_new(ref, 1)
    k2 = first_new(ref, k1 + 1)
    model.config.eos_token_id = ref[k1]
    model.generation_config.eos_token_id = [ref[k2]]
    cfg = dict(max_new_tokens=16, **TREE)
    assert specla.run(model, "gdn", prompts=[prompt], config=cfg).outputs == [ref[: k2 + 1]]
    model.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").is_file()
    dec = SpecDecoder(tmp_path, "gdn", config=dict(cfg, dtype="float32"))
    assert dec.model.config.eos_token_id == ref[k1] and dec.adapter.eos_token_ids == (ref[k2],)
    assert dec.generate([prompt]).outputs == [ref[: k2 + 1]]
    model.generation_config.eos_token_id = None  # no generation eos: the config's
    assert specla.run(model, "gdn", prompts=[prompt], config=cfg).outputs == [ref[: k1 + 1]]


def test_the_example_plugin_stops_at_a_list_of_eos_ids():
    p = get_plugin("retention")
    model = p.tiny_model(next(iter(p.tiny_variants)), seed=0, dtype=torch.float32)
    prompt = [4, 8, 4, 8, 4]
    ref = p.reference_decode(model, prompt, 12)
    k = first_new(ref, 2)
    model.config.eos_token_id = [ref[k]]
    r = specla.run(model, "retention", prompts=[prompt], config=dict(max_new_tokens=12, **TREE))
    assert r.outputs == [ref[: k + 1]]


# ------------------------------------------------------------------ Triton mode of the test run


def test_the_test_run_interprets_triton_only_without_cuda():
    import conftest

    never = lambda: pytest.fail("an explicit TRITON_INTERPRET must not probe CUDA")  # noqa: E731
    assert conftest.triton_interpret_default({}, lambda: True) == "0"
    assert conftest.triton_interpret_default({}, lambda: False) == "1"
    assert conftest.triton_interpret_default({"TRITON_INTERPRET": "1"}, never) == "1"
    assert conftest.triton_interpret_default({"TRITON_INTERPRET": "0"}, never) == "0"


@pytest.mark.parametrize("cuda, env, expected", [(True, None, "0"), (False, None, "1"), (True, "1", "1")])
def test_conftest_sets_the_mode_before_triton_is_imported(cuda, env, expected):
    """A fresh interpreter imports tests/conftest.py with CUDA reported (un)available: the mode
    it leaves in the environment, that triton was not imported before, and that a Triton kernel
    defined afterwards is interpreted exactly when the mode is ``1``."""
    code = (
        "import os, sys, torch\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        "before = 'triton' in sys.modules\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import conftest\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "from specla.ops import norm_triton\n"
        "print(os.environ['TRITON_INTERPRET'], before, isinstance(norm_triton._rms_norm_kernel, InterpretedFunction))\n"
    )
    env_vars = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env is not None:
        env_vars["TRITON_INTERPRET"] = env
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == f"{expected} False {expected == '1'}"


def test_the_fla_oracle_skips_where_fla_kernels_are_compiled(monkeypatch):
    import fla_oracle

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(fla_oracle, "_ENABLED", False)  # as in a process that compiled FLA's kernels
    with pytest.raises(pytest.skip.Exception, match="needs FLA's kernels under Triton's CPU interpreter"):
        fla_oracle.enable_fla_interpreter()


# ------------------------------------------------------------------ e2e: the transformers generate row


def load_e2e():
    spec = importlib.util.spec_from_file_location("e2e_bench_compat", ROOT / "benchmarks" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_exact_rate_compares_each_output_with_its_reference_prefix():
    e2e = load_e2e()
    assert e2e.exact_rate([[1, 2], [3, 4]], [[1, 2, 9], [3, 5, 9]]) == 0.5
    assert e2e.exact_rate([[1, 2, 9]], [[1, 2, 9]]) == 1.0
    with pytest.raises(ValueError, match="longer than its reference"):
        e2e.exact_rate([[1, 2, 3]], [[1, 2]])
    with pytest.raises(ValueError, match="2 outputs against 1 references"):
        e2e.exact_rate([[1], [2]], [[1]])


def test_library_versions_are_the_installed_ones():
    from specla.bench import library_versions

    v = library_versions()
    assert list(v) == ["torch", "triton", "transformers", "flash-linear-attention", "fla-core", "specla"]
    assert v["specla"] == importlib.metadata.version("specla")
    assert v["transformers"] == importlib.metadata.version("transformers")
    assert v["flash-linear-attention"] == importlib.metadata.version("flash-linear-attention")
    assert v["torch"] == importlib.metadata.version("torch") and v["triton"] == importlib.metadata.version("triton")


def test_the_transformers_generate_row_is_checked_against_ar():
    """The row's ``exact`` is the share of its tokens equal to specla's AR tokens: 1.0 with
    FLA's uncached ``generate``; its cached ``generate`` (what the row times) matches AR only
    with transformers < 5.24, where the cache still reaches FLA's model (docs/usage.md,
    "Precision and exactness")."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # FLA's kernels on the CPU
        from fla_oracle import enable_fla_interpreter

        enable_fla_interpreter()
        dev = "cpu"
    elif torch.cuda.is_available():  # FLA's kernels compiled
        dev = "cuda"
    else:
        pytest.skip("FLA's kernels need CUDA or TRITON_INTERPRET=1")
    e2e = load_e2e()
    model = get_plugin("gdn").tiny_model("base", seed=0, dtype=torch.float32).to(dev)
    prompts = [[3, 17, 5, 9], [40, 2, 33, 8]]
    n = 6
    ar = SpecDecoder(model, "gdn", config=dict(num_draft_tokens=0, max_new_tokens=8, stop_at_eos=False,
                                               dtype="float32", device=dev)).generate(prompts).outputs
    assert e2e.exact_rate(e2e.hf_generate_outputs(model, prompts, n, use_cache=False), ar) == 1.0
    h = e2e.Harness.__new__(e2e.Harness)  # the row's own code, on the tiny model (no GPU)
    h.model, h.prompts, h.args = model, prompts, SimpleNamespace(hf_tokens=n, repeats=1)
    row = h.hf_generate(2, 100.0, ar)
    assert set(row) == {"tokens_per_s", "vs_ar_graph", "ms_per_step", "exact"}
    tf = tuple(int(x) for x in importlib.metadata.version("transformers").split(".")[:2])
    assert row["exact"] == (1.0 if tf < (5, 24) else 0.0)
    with pytest.raises(ValueError, match="prompts of one length"):
        e2e.hf_generate_outputs(model, [[1, 2], [3]], n)
