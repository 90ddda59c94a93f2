"""Sequence mixers: the contract every mixer meets (:mod:`specla.mixers.base`) and the op tier: one
subpackage per op (``attention``, ``gdn``, ``gla``, ``mamba2``, ``kda``, ``shortconv``) with its
mixer, records, batched PyTorch reference, sequential twins and Triton kernels side by side. Model
plugins build their layers from these; nothing here names a model plugin. The names below are the
package's API."""

from .attention.mixer import AttentionMixer, ProjectedAttention
from .attention.records import KVRecord
from .base import Mixer, RecurrentMixer, TreePass, experts_graph_problem

__all__ = ["AttentionMixer", "KVRecord", "Mixer", "ProjectedAttention", "RecurrentMixer",
           "TreePass", "experts_graph_problem"]
