"""Sequence mixers: the contract every mixer meets, the softmax-attention mixer and the layer loop
that runs a stack of them (:mod:`specla.mixers.base`)."""

from .base import (
    AttentionMixer,
    KVRecord,
    Mixer,
    MixerAdapter,
    ProjectedAttention,
    RecurrentMixer,
    TreePass,
    experts_graph_problem,
)

__all__ = ["AttentionMixer", "KVRecord", "Mixer", "MixerAdapter", "ProjectedAttention", "RecurrentMixer",
           "TreePass", "experts_graph_problem"]
