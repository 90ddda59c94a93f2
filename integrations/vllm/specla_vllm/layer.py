"""specla's GDN layer in vLLM: a subclass of vLLM 0.34.0's ``QwenGatedDeltaNetAttention``."""

from __future__ import annotations

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention


class SpeclaQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's Qwen GDN layer (Qwen3-Next, Qwen3.5), built by vLLM in its place once
    :func:`specla_vllm.register` has run: same constructor, parameters, weight loading, state shape
    (``get_state_shape``: conv ``[conv_dim / tp, conv_kernel - 1 + num_spec]`` and recurrent
    ``[HV / tp, V, K]`` float32 per slot) and forward, all vLLM's.

    Its speculative path is vLLM's too: ``fused_sigmoid_gating_delta_rule_update`` writes a full
    ``[HV, V, K]`` state into one slot per draft position (``spec_state_indices_tensor [N, T]``) and
    the next step reads slot ``num_accepted_tokens - 1``. specla's ``gdn_pool_verify`` /
    ``gdn_pool_commit`` (one slot per request, factor records) do not run here yet.
    """
