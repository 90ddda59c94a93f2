"""What the vLLM plugin's tests share: a small Qwen3-Next GDN layer's HF config and a current
``VllmConfig`` on vLLM's CPU platform with vLLM's model-parallel groups up."""

import contextlib
import tempfile
import types

import torch
from transformers import Qwen3NextConfig
from vllm.config import VllmConfig, set_current_vllm_config

# a small Qwen3-Next GDN layer: 2 key heads, 4 value heads of dimension 16, conv kernel 4
HF_CONFIG = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=128,
                            intermediate_size=64)


@contextlib.contextmanager
def current_vllm_config(dtype: torch.dtype = torch.bfloat16, speculative_config=None):
    """A ``VllmConfig`` of vLLM's CPU platform, current, with vLLM's model-parallel groups of world
    size 1 over gloo, a model config holding only what the layer reads (the HF config, ``dtype``;
    a full ``ModelConfig`` would load a checkpoint's) and ``speculative_config``; torn down after."""
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)

    config = VllmConfig()
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp}/init")
        initialize_model_parallel(1)
        object.__setattr__(config, "model_config", types.SimpleNamespace(hf_text_config=HF_CONFIG, dtype=dtype))
        object.__setattr__(config, "speculative_config", speculative_config)
        try:
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
