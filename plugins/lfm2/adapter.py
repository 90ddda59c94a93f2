"""Turns transformers' ``Lfm2ForCausalLM`` (Liquid AI's LFM2) into a :class:`specla.TargetAdapter`
on the mixer core.

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

from specla.config import SpecConfig
from specla.layerwise import eos_token_ids
from specla.mixers import Mixer, MixerAdapter, ProjectedAttention
from specla.mixers.shortconv.mixer import ShortConvMixer


class Lfm2Adapter(MixerAdapter):
    """LFM2 on the mixer core (see the module docstring).

    State per sequence: for each convolution layer its window ``[B, L - 1, hidden]``, for each
    attention layer a KV cache ``[B, capacity + 65, HKV, Dh]`` with its length, all in the
    activation dtype. The model's modules are used as they are when the run's device and dtype
    are the model's and it is in eval mode; otherwise a converted copy in eval mode is made once
    (the caller's model is never modified).

    Args:
        model: a ``Lfm2ForCausalLM`` (checked by the plugin).
        config: the run's :class:`SpecConfig`.
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig):
        model = self._adopt(model, config, model.lm_head.weight)
        self.model, inner = model, model.model
        self.inner = inner
        self.embed_weight = inner.embed_tokens.weight.detach()
        self.vocab_size = self.embed_weight.shape[0]
        self.eos_token_ids = eos_token_ids(model)
        self.layers = list(inner.layers)
        self.num_layers = len(self.layers)
        self.mixers = [self._mixer(layer) for layer in self.layers]
        self._init_state()

    def _mixer(self, layer: torch.nn.Module) -> Mixer:
        if not layer.is_attention_layer:
            return ShortConvMixer(layer.conv, self.dtype, self.device)
        a = layer.self_attn
        return ProjectedAttention(q_proj=a.q_proj, k_proj=a.k_proj, v_proj=a.v_proj, o_proj=a.out_proj,
                                  num_kv_heads=a.k_proj.out_features // a.head_dim, head_dim=a.head_dim,
                                  dtype=self.dtype, device=self.device, scale=a.scaling, q_norm=a.q_layernorm,
                                  k_norm=a.k_layernorm, rotary=self.inner.rotary_emb,
                                  apply_rotary=sys.modules[type(a).__module__].apply_rotary_pos_emb)

    def _block(self, li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """``Lfm2DecoderLayer``: ``x + mix(operator_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""
        layer = self.layers[li]
        x = x + mix(layer.operator_norm(x))
        return x + layer.feed_forward(layer.ffn_norm(x))

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., vocab]``: the final norm (``embedding_norm``) and the LM head."""
        return self.model.lm_head(self.inner.embedding_norm(hidden))
