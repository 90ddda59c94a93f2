"""End-of-sequence ids as transformers' ``generate`` reads them: a list of ids, the generation
config's before the model config's, for every plugin and for a checkpoint directory."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specla
from specla import SpecDecoder
from specla.errors import UnsupportedModelError
from specla.hf import eos_token_ids
from specla.registry import get_plugin

TREE = dict(num_draft_tokens=6, max_depth=4, top_k=2)


def first_new(ref: list[int], start: int) -> int:
    """The first index ``k >= start`` whose token does not occur in ``ref[:k]``."""
    return next(k for k in range(start, len(ref)) if ref[k] not in ref[:k])


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
