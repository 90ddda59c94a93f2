"""The plugin's wiring inside vLLM 0.34.0, on vLLM's own objects: its entry point loads through
vLLM's plugin loader (``load_general_plugins``, ``VLLM_PLUGINS``), and a model's construction of
vLLM's ``QwenGatedDeltaNetAttention`` then builds specla's class, with vLLM's parameters and state
shape; under another vLLM version nothing is registered.

The layer is built on a CPU with vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``), a gloo process
group of world size 1 and a model config holding only the HF config the layer reads. vLLM's CPU
platform refuses x86 without a Triton driver (``CpuPlatform.check_and_update_config``), and Triton
without a GPU has none (its interpreter runs kernels on a CPU); vLLM accepts Triton with no driver
where ``CUDA_VISIBLE_DEVICES`` is empty (``vllm/triton_utils/importing.py``, its case of a worker
whose devices are not yet assigned), which these tests set where torch sees no GPU. vLLM's modules
then import Triton itself, not placeholders. Building a layer runs no kernel."""

import importlib.metadata
import importlib.util
import logging
import os
import tempfile
import types

import pytest

if importlib.util.find_spec("vllm") is None:  # installed but failing to import is a failure, not a skip
    pytest.skip("vLLM is not installed: see integrations/vllm/README.md for the test environment",
                allow_module_level=True)

import torch  # noqa: E402

# before vLLM resolves its platform and Triton's drivers
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
import vllm.plugins  # noqa: E402
from transformers import Qwen3NextConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402

import specla_vllm  # noqa: E402
from specla_vllm.layer import SpeclaQwenGatedDeltaNetAttention  # noqa: E402

KEY = "QwenGatedDeltaNetAttention"
# a small Qwen3-Next GDN layer: 2 key heads, 4 value heads of dimension 16, conv kernel 4
HF_CONFIG = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=128,
                            intermediate_size=64)


@pytest.fixture(scope="module")
def vllm_config():
    """A ``VllmConfig`` of vLLM's CPU platform, current, with vLLM's model-parallel groups of world
    size 1 over gloo; torn down afterwards."""
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)

    config = VllmConfig()
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp}/init")
        initialize_model_parallel(1)
        # what the layer reads of the model config (a full ModelConfig would load a checkpoint's)
        object.__setattr__(config, "model_config", types.SimpleNamespace(hf_text_config=HF_CONFIG))
        try:
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


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
