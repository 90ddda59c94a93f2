"""``EngineOptions``: the engine's mode switches under ``SpecConfig.engine``, and the flat keys
of the previous release, still accepted with a ``DeprecationWarning``."""

import json
import warnings

import pydantic
import pytest

import specla
from specla import EngineOptions, SpecConfig
from specla.apps.cli import read_config_option
from specla_fla.plugin import TINY_TARGET

# a value other than the default for every option
CHANGED = {"commit": "replay", "kernels": "reference", "verify_kernel": "serial", "cuda_graphs": "off",
           "budget_policy": "fixed", "prefill": "chain"}
PROMPTS = [[5, 9, 2, 7], [3]]


def deprecation(key, value) -> str:
    return (f"SpecConfig field {key!r} is deprecated and will be removed in the next release: "
            f"use engine={{{key!r}: {value!r}}}")


def test_the_options_and_their_defaults():
    assert tuple(EngineOptions.model_fields) == tuple(CHANGED)
    assert SpecConfig().engine == EngineOptions()
    assert EngineOptions().model_dump() == dict(commit="factor", kernels="auto", verify_kernel="auto",
                                                cuda_graphs="auto", budget_policy="auto", prefill="auto")
    assert not set(CHANGED) & set(SpecConfig.model_fields)  # one spelling each
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        EngineOptions(graphs="off")
    with pytest.raises(pydantic.ValidationError, match="Instance is frozen"):
        EngineOptions().kernels = "triton"


@pytest.mark.parametrize("key", CHANGED)
def test_a_flat_key_warns_with_its_new_spelling_and_maps_into_engine(key):
    value = CHANGED[key]
    with pytest.warns(DeprecationWarning) as caught:
        config = SpecConfig(num_draft_tokens=3, **{key: value})
    assert [str(w.message) for w in caught] == [deprecation(key, value)]
    assert caught[0].filename == __file__  # the caller's line, not pydantic's
    assert config == SpecConfig(num_draft_tokens=3, engine={key: value})
    assert getattr(config.engine, key) == value


def test_all_flat_keys_at_once_warn_each_and_map_exactly():
    with pytest.warns(DeprecationWarning) as caught:
        config = SpecConfig(**CHANGED)
    assert [str(w.message) for w in caught] == [deprecation(k, v) for k, v in CHANGED.items()]
    assert config.engine == EngineOptions(**CHANGED)


def test_flat_keys_beside_engine_are_refused():
    with pytest.raises(pydantic.ValidationError) as err:
        SpecConfig(kernels="reference", prefill="chain", engine={"commit": "replay"})
    assert [e["msg"] for e in err.value.errors()] == [
        "Value error, kernels, prefill given both flat and with engine: give the engine options in engine only "
        "(engine={'kernels': ...})"]


def test_a_flat_value_outside_its_choices_is_refused_under_engine():
    with pytest.warns(DeprecationWarning) as caught, pytest.raises(pydantic.ValidationError) as err:
        SpecConfig(kernels="fast")
    assert [e["loc"] for e in err.value.errors()] == [("engine", "kernels")]
    # the new spelling offered is one that runs, not the refused value moved under engine
    assert [str(w.message) for w in caught] == [
        "SpecConfig field 'kernels' is deprecated and will be removed in the next release: use engine={'kernels': X} "
        "with X one of 'auto', 'reference', 'triton' ('fast' is none of them)"]


def test_json_round_trip_keeps_engine_nested():
    config = SpecConfig(num_draft_tokens=5, temperature=0.5, engine=CHANGED)
    dumped = config.model_dump(mode="json")
    assert dumped["engine"] == CHANGED and not set(CHANGED) & set(dumped)
    assert SpecConfig.model_validate_json(config.model_dump_json()) == config
    assert SpecConfig(**json.loads(json.dumps(dumped))) == config
    with pytest.warns(DeprecationWarning):  # a config file of the previous release
        old = SpecConfig.model_validate_json(json.dumps({**{k: v for k, v in dumped.items() if k != "engine"},
                                                         **CHANGED}))
    assert old == config


def test_with_engine_replaces_options_and_validates():
    config = SpecConfig(engine={"commit": "replay"})
    assert config.with_engine(cuda_graphs="off").engine == EngineOptions(commit="replay", cuda_graphs="off")
    assert config.engine.cuda_graphs == "auto"  # frozen: a new config
    with pytest.raises(pydantic.ValidationError):
        config.with_engine(cuda_graphs="sometimes")


def test_a_config_file_with_flat_keys_is_nested_once_so_flags_override_it():
    with pytest.warns(DeprecationWarning) as caught:
        fields = read_config_option(json.dumps({"commit": "replay", "temperature": 0.5}))
    assert [str(w.message) for w in caught] == [deprecation("commit", "replay")]
    assert fields == {"temperature": 0.5, "engine": {"commit": "replay"}}


def test_the_library_passes_no_flat_key_and_flat_dicts_still_decode_the_same():
    """Runs through the API (graphs' fixed-shape step, the adaptive policy's candidate configs,
    a baseline commit) warn nothing; a dict of flat keys gives the same tokens as plain
    decoding, with its warning."""
    plain = specla.run(str(TINY_TARGET), None, prompts=PROMPTS, config=dict(num_draft_tokens=0, max_new_tokens=12))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for engine in ({"cuda_graphs": "unrecorded"}, {"budget_policy": "adaptive", "cuda_graphs": "off"},
                       {"commit": "replay"}):
            out = specla.run(str(TINY_TARGET), None, prompts=PROMPTS,
                             config=dict(num_draft_tokens=4, max_depth=4, max_new_tokens=12, engine=engine))
            assert out.outputs == plain.outputs, engine
    with pytest.warns(DeprecationWarning) as caught:
        out = specla.run(str(TINY_TARGET), None, prompts=PROMPTS,
                         config=dict(num_draft_tokens=4, max_depth=4, max_new_tokens=12, commit="replay"))
    assert [str(w.message) for w in caught] == [deprecation("commit", "replay")]
    assert out.outputs == plain.outputs
