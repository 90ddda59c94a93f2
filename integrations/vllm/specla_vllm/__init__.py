"""vLLM plugin: vLLM builds specla's GDN layer, :class:`~specla_vllm.layer.SpeclaQwenGatedDeltaNetAttention`,
wherever its models build ``QwenGatedDeltaNetAttention`` (Qwen3-Next, Qwen3.5).

vLLM calls :func:`register` in each of its processes (entry-point group ``vllm.general_plugins``);
it registers the class out of tree (``PluggableLayer.register_oot``), which ``PluggableLayer.__new__``
looks up by the Python name of the class being built, ``"QwenGatedDeltaNetAttention"`` (not by its
registered layer name, ``"qwen_gated_delta_net_attention"``).

The class keeps vLLM's layer but for its speculative (chain) rows: one recurrent-state slot a
request, chains verified by specla's ``gdn_pool_verify`` into factor records and committed by
``gdn_pool_commit`` at the request's next step (integrations/vllm/README.md). Pinned to vLLM 0.34.0,
whose layer it subclasses.
"""

from __future__ import annotations

import importlib.metadata
import logging

__all__ = ["register", "VLLM_VERSION"]

VLLM_VERSION = "0.34.0"
logger = logging.getLogger(__name__)


def register() -> None:
    """The entry point: registers :class:`~specla_vllm.layer.SpeclaQwenGatedDeltaNetAttention` in
    place of vLLM's ``QwenGatedDeltaNetAttention``, once a process (vLLM may load its plugins more
    than once, and its registry refuses a name twice), or nothing, with a warning, under a vLLM
    other than :data:`VLLM_VERSION`."""
    installed = importlib.metadata.version("vllm")
    if installed != VLLM_VERSION:
        logger.warning("specla-vllm supports vLLM %s, not %s: its layer is not registered", VLLM_VERSION, installed)
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from .layer import SpeclaQwenGatedDeltaNetAttention

    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not SpeclaQwenGatedDeltaNetAttention:
        QwenGatedDeltaNetAttention.register_oot(SpeclaQwenGatedDeltaNetAttention)
