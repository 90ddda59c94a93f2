"""Sequence mixers: the contract every mixer meets and the softmax-attention mixer
(:mod:`specla.mixers.base`, exported here), and the op tier: one
subpackage per recurrence (``gdn``, ``gla``, ``mamba2``, ``kda``, ``shortconv``) with its mixer,
records, batched PyTorch reference, sequential twins and Triton kernels side by side. Model plugins
build their layers from these; nothing here names a model plugin."""

from .base import (
    AttentionMixer,
    KVRecord,
    Mixer,
    ProjectedAttention,
    RecurrentMixer,
    TreePass,
    experts_graph_problem,
)

__all__ = ["AttentionMixer", "KVRecord", "Mixer", "ProjectedAttention", "RecurrentMixer",
           "TreePass", "experts_graph_problem"]
