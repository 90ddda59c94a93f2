"""Describes transformers' ``Lfm2ForCausalLM`` (Liquid AI's LFM2) as a
:class:`specla.model.spec.ModelSpec`.

LFM2 interleaves gated short convolutions with grouped-query softmax attention. A short
convolution's state is its window of the last ``L - 1`` inputs, so under a draft tree it follows
each node's root path like the short convs of the recurrent layers:
:class:`~specla.mixers.shortconv.mixer.ShortConvMixer` (tree-aware convolution, the window
committed along the accepted path). Attention layers run the core's
:class:`specla.mixers.ProjectedAttention` with the layer's own projections, per-head q/k norms and
rotary module; everything position-wise (embeddings, norms, the SwiGLU feed-forward, the
LM head) is the checkpoint's transformers module, called on the verify rows.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers import Mixer, ProjectedAttention
from specla.mixers.shortconv.mixer import ShortConvMixer
from specla.model.spec import ModelSpec, Placement


def lfm2_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """LFM2 as a :class:`ModelSpec` (see the module docstring).

    State per sequence: for each convolution layer its window ``[B, L - 1, hidden]``, for each
    attention layer a KV cache ``[B, capacity + 65, HKV, Dh]`` with its length, all in the
    activation dtype.

    Args:
        model: a ``Lfm2ForCausalLM`` (checked by the plugin), on the run's device and dtype.
        placement: the run's :class:`Placement`.
    """
    inner, lm_head = model.model, model.lm_head
    layers = list(inner.layers)

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """``Lfm2DecoderLayer``: ``x + mix(operator_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""
        layer = layers[li]
        x = x + mix(layer.operator_norm(x))
        return x + layer.feed_forward(layer.ffn_norm(x))

    def logits(hidden: Tensor) -> Tensor:
        """The final norm (``embedding_norm``) and the LM head."""
        return lm_head(inner.embedding_norm(hidden))

    return ModelSpec(model=model, embed_weight=inner.embed_tokens.weight.detach(), logits=logits,
                     mixers=tuple(_mixer(layer, inner, placement) for layer in layers), block=block,
                     num_layers=len(layers), eos_token_ids=eos_token_ids(model))


def _mixer(layer: torch.nn.Module, inner: torch.nn.Module, placement: Placement) -> Mixer:
    if not layer.is_attention_layer:
        return ShortConvMixer(layer.conv, placement.dtype, placement.device)
    a = layer.self_attn
    return ProjectedAttention(q_proj=a.q_proj, k_proj=a.k_proj, v_proj=a.v_proj, o_proj=a.out_proj,
                              num_kv_heads=a.k_proj.out_features // a.head_dim, head_dim=a.head_dim,
                              dtype=placement.dtype, device=placement.device, scale=a.scaling, q_norm=a.q_layernorm,
                              k_norm=a.k_layernorm, rotary=inner.rotary_emb,
                              apply_rotary=sys.modules[type(a).__module__].apply_rotary_pos_emb)
