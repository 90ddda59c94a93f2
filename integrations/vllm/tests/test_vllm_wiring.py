"""The plugin's wiring inside vLLM 0.34.0, on vLLM's own objects: its entry point loads through
vLLM's plugin loader (``load_general_plugins``, ``VLLM_PLUGINS``), and a model's construction of
vLLM's ``QwenGatedDeltaNetAttention`` then builds specla's class, with vLLM's parameters and state
shape; under another vLLM version nothing is registered.

The layer is built on a CPU with vLLM's CPU platform (``vllm_env.py`` sets the environment), a gloo
process group of world size 1 and a model config holding only what the layer reads
(``vllm_cases.current_vllm_config``). Building a layer runs no kernel."""

import importlib.metadata
import importlib.util
import logging

import pytest

if importlib.util.find_spec("vllm") is None:  # installed but failing to import is a failure, not a skip
    pytest.skip("vLLM is not installed: see integrations/vllm/README.md for the test environment",
                allow_module_level=True)

import vllm_env  # noqa: E402,F401  (the environment first: see its docstring)
import torch  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402

import specla_vllm  # noqa: E402
from specla_vllm.layer import SpeclaQwenGatedDeltaNetAttention  # noqa: E402
from vllm_cases import HF_CONFIG, current_vllm_config  # noqa: E402

KEY = "QwenGatedDeltaNetAttention"


@pytest.fixture(scope="module")
def vllm_config():
    with current_vllm_config() as config:
        yield config


@pytest.fixture
def registry(monkeypatch):
    """vLLM's out-of-tree registry and plugin loader as a fresh process has them; restored after."""
    monkeypatch.delitem(op_registry_oot, KEY, raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    yield op_registry_oot
    op_registry_oot.pop(KEY, None)


_layers = iter(range(1_000))


def build(config):
    """vLLM's ``QwenGatedDeltaNetAttention`` built as a model builds it (a fresh layer prefix each
    call: vLLM refuses a prefix twice)."""
    return QwenGatedDeltaNetAttention(HF_CONFIG, config, prefix=f"model.layers.{next(_layers)}.linear_attn")


def test_vllm_loader_registers_specla_layer_and_vllm_builds_it(vllm_config, registry):
    plain = build(vllm_config)
    assert type(plain) is QwenGatedDeltaNetAttention

    vllm.plugins.load_general_plugins()

    assert registry[KEY] is SpeclaQwenGatedDeltaNetAttention
    layer = build(vllm_config)
    assert type(layer) is SpeclaQwenGatedDeltaNetAttention
    assert vllm_config.compilation_config.static_forward_context[layer.prefix] is layer
    # vLLM's state pool and weight loading see the same layer: state shapes, parameter names and shapes
    assert layer.get_state_shape() == plain.get_state_shape() == ((3, 128), (4, 16, 16))
    assert {n: p.shape for n, p in layer.named_parameters()} == {n: p.shape for n, p in plain.named_parameters()}
    assert layer.A_log.dtype == torch.float32


def test_vllm_plugins_naming_other_plugins_leaves_vllm_layer(vllm_config, registry, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")

    vllm.plugins.load_general_plugins()

    assert KEY not in registry
    assert type(build(vllm_config)) is QwenGatedDeltaNetAttention


def test_register_twice_in_one_process(vllm_config, registry):
    specla_vllm.register()
    specla_vllm.register()  # vLLM's registry asserts on a duplicate name

    assert registry[KEY] is SpeclaQwenGatedDeltaNetAttention
    assert type(build(vllm_config)) is SpeclaQwenGatedDeltaNetAttention


def test_other_vllm_version_registers_nothing(vllm_config, registry, monkeypatch, caplog):
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.35.0" if name == "vllm" else version(name))

    with caplog.at_level(logging.WARNING, logger="specla_vllm"):
        specla_vllm.register()

    assert KEY not in registry
    assert caplog.messages == ["specla-vllm supports vLLM 0.34.0, not 0.35.0: its layer is not registered"]
    assert type(build(vllm_config)) is QwenGatedDeltaNetAttention
