"""Turns transformers' ``Lfm2ForCausalLM`` (Liquid AI's LFM2) into a :class:`specla.TargetAdapter`
on the mixer core.

LFM2 interleaves gated short convolutions with grouped-query softmax attention. A short
convolution's state is its window of the last ``L - 1`` inputs, so under a draft tree it follows
each node's root path like the short convs of the recurrent layers: :class:`ShortConvMixer`
(tree-aware convolution, the window committed along the accepted path). Attention layers run the
core's :class:`specla.mixers.ProjectedAttention` with the layer's own projections, per-head q/k
norms and rotary module; everything position-wise (embeddings, norms, the SwiGLU feed-forward, the
LM head) is the checkpoint's transformers module, called on the verify rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from specla.config import SpecConfig
from specla.layerwise import eos_token_ids
from specla.mixers import Mixer, MixerAdapter, ProjectedAttention, TreePass
from specla.ops.conv import conv_window_after, conv_windows_per_node, tree_conv
from specla.records import Record, take_accepted


@dataclass(frozen=True)
class ConvRecord(Record):
    """A short convolution's factor and replay record: the nodes' convolution inputs, from which
    the commit takes the accepted path's into the window."""

    conv_x: Tensor  # [B, T, D] activation dtype, B * x before the convolution


@dataclass(frozen=True)
class ConvSnapshotRecord(Record):
    """The snapshot strategy's record: the window after each node's root path."""

    conv_windows: Tensor  # [B, T, L - 1, D] activation dtype


class ShortConvMixer(Mixer):
    """LFM2's gated short convolution (``Lfm2ShortConv``) under draft trees: ``B, C, x =
    in_proj(h)`` (in that order), ``y = C * conv(B * x)`` with a causal depthwise convolution of
    width ``L`` and no activation, then ``out_proj(y)``; the convolution reads each node's last
    ``L - 1`` inputs along its root path (:func:`specla.ops.conv.tree_conv`).

    State: the window ``[B, L - 1, D]`` of committed inputs in the activation dtype (fixed-size,
    like the conv windows of the recurrent mixers, and not in float32: no recurrence accumulates
    in it).

    Args:
        conv: the layer's ``Lfm2ShortConv`` module (``in_proj``, ``conv``, ``out_proj``).
        dtype, device: the window's.
    """

    recurrent = False

    def __init__(self, conv: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        self.module, self.dtype, self.device = conv, dtype, device
        self.weight = conv.conv.weight.detach()[:, 0]  # [D, L]
        self.bias = conv.conv.bias.detach() if conv.conv.bias is not None else None
        self.L = self.weight.shape[1]
        self.empty_state(0, 0)

    def empty_state(self, B: int, capacity: int) -> None:
        self.conv = torch.zeros(B, self.L - 1, self.weight.shape[0], dtype=self.dtype, device=self.device)

    def empty_record(self, B: int, T: int) -> ConvRecord:
        return ConvRecord(torch.zeros(B, T, self.weight.shape[0], dtype=self.dtype, device=self.device))

    def state(self) -> list[Tensor]:
        return [self.conv]

    def state_names(self) -> list[str]:
        return ["conv window"]

    def set_state(self, tensors) -> None:
        self.conv = next(tensors)

    def verify(self, h: Tensor, tp: TreePass, pending: Record | None) -> tuple[Tensor, Record]:
        if pending is not None:  # the delayed commit of the previous step
            self.conv = conv_window_after(pending.conv_x, self.conv, tp.path, tp.path_len)
        Bg, Cg, x = self.module.in_proj(h).chunk(3, dim=-1)
        bx = Bg * x
        anc = tp.conv_ancestors(self.L)
        y = Cg * tree_conv(bx, self.conv, self.weight, self.bias, anc, silu=False)
        if tp.records == "snapshot":
            rec = ConvSnapshotRecord(conv_windows_per_node(bx, self.conv, anc))
        else:  # factor and replay: the inputs are the whole record
            rec = ConvRecord(conv_x=bx)
        return self.module.out_proj(y), rec

    prefill_continues = True  # the convolution reads the window it holds

    def prefills_whole(self, kernels: bool) -> bool:
        return True

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts from the window it holds (:meth:`specla.mixers.Mixer.prefill`): the
        convolution along each prompt (the same operator on the chain) and the window after each
        row's ``tp.counts`` inputs."""
        Bg, Cg, x = self.module.in_proj(h).chunk(3, dim=-1)
        bx = Bg * x
        y = Cg * tree_conv(bx, self.conv, self.weight, self.bias, tp.conv_ancestors(self.L), silu=False)
        self.conv = conv_window_after(bx, self.conv, tp.chain()[0], tp.counts)
        return self.module.out_proj(y)

    def commit(self, record: Record, path: Tensor, path_len: Tensor, kernels: bool) -> None:
        if isinstance(record, ConvSnapshotRecord):
            self.conv = take_accepted(record.conv_windows, self.conv, path, path_len)
        else:
            self.conv = conv_window_after(record.conv_x, self.conv, path, path_len)


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
