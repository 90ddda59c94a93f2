"""Turns an FLA ``GLAForCausalLM`` into a :class:`specla.TargetAdapter` on the mixer core.

FLA's modules are Triton-only, so they cannot serve CPU users: each block's sequence mixer is a
:class:`specla.mixers.gla.mixer.GLAMixer` (its reference path in PyTorch, or the op's Triton kernels
with the fused delayed commit) built from the block's own weights, following
``fla/layers/gla.py``: q/k/v projections, optional tree-aware short convolution + SiLU,
key/value/decay heads repeated to the query heads (``num_kv_heads``), the low-rank decay
``gk = logsigmoid(W2 W1 h + b2) / gate_logit_normalizer`` (then ``clamp_min``), the feature map on
q and k, tree-masked GLA with factor records, RMSNorm (gated by ``swish(g_proj h)`` with
``use_output_gate``), output projection. The block around it: pre-norm, mixer, residual, then the
MLP; final norm and LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.config import SpecConfig
from specla.fla_attention import fla_attention_mixer, is_fla_attention
from specla.mixers import Mixer, MixerAdapter
from specla.mixers.gla.mixer import GLAMixer
from specla.ops.norm import rms_norm

from .plugin import FEATURE_MAPS


def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm with an optional weight (``elementwise_affine=False`` has none)."""
    return rms_norm(x, weight if weight is not None else torch.ones((), dtype=x.dtype, device=x.device), eps)


class GLAAdapter(MixerAdapter):
    """FLA's GLA on the mixer core (see the module docstring).

    State per sequence, per block: the :class:`GLAMixer` state, ``[B, H, K, V]`` float32 (float64
    for float64 runs) and the conv window ``[B, C - 1, Dc]`` (none without short conv). Weights are
    read from ``model`` once; ``model`` itself is not modified.

    Args:
        model: a ``fla.models.GLAForCausalLM`` (checked by the plugin).
        config: the run's :class:`SpecConfig` (``dtype``/``device`` override the model's).
        differentiable: build the weights without detaching them, so :meth:`score` can be
            trained through.
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig, *, differentiable: bool = False):
        self.differentiable = differentiable
        self._place(config, model.lm_head.weight)
        m = model.model
        self._copy_head(model, m.embeddings, m.norm)
        feature_map = FEATURE_MAPS[model.config.feature_map]
        self.blocks = [(self._act(b.attn_norm.weight), b.attn_norm.eps, self._act(b.mlp_norm.weight), b.mlp_norm.eps,
                        self._act(b.mlp.gate_proj.weight), self._act(b.mlp.up_proj.weight),
                        self._act(b.mlp.down_proj.weight)) for b in m.layers]
        self.mixers = [self._mixer(b.attn, feature_map) for b in m.layers]
        self.num_layers = len(self.mixers)
        self._init_state()

    def _mixer(self, a: torch.nn.Module, feature_map) -> Mixer:
        act = self._act
        if is_fla_attention(a):  # a softmax-attention layer of FLA's hybrid configs (config.attn)
            return fla_attention_mixer(a, act, self.dtype, self.device)
        conv = [a.q_conv1d, a.k_conv1d, a.v_conv1d] if a.use_short_conv else None
        onorm = a.g_norm_swish_gate if a.fuse_norm_and_gate else a.g_norm
        w_qkv = act(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        w_gk1, w_gk2 = act(a.gk_proj[0].weight), act(a.gk_proj[1].weight)
        w_g = act(a.g_proj.weight) if a.use_output_gate else None
        o_norm, o_eps, w_o = act(onorm.weight), onorm.eps, act(a.o_proj.weight)
        # values, not self, in the mixer's closures (see LayerwiseAdapter)
        H, V, dtype = a.num_heads, a.head_v_dim, self.dtype

        def project(h: Tensor):
            return h @ w_qkv.T, (h @ w_gk1.T) @ w_gk2.T, (h @ w_g.T if w_g is not None else None)

        def output(o: Tensor, gate: Tensor | None) -> Tensor:
            B, T = o.shape[:2]
            o = _rms(o, o_norm, o_eps)
            if gate is not None:  # FusedRMSNormGated(swish), or g_norm then gate_fn = swish
                o = o * F.silu(gate.view(B, T, H, V).to(o.dtype))
            return o.reshape(B, T, -1).to(dtype) @ w_o.T

        b_gk = (a.gk_proj[1].bias if self.differentiable else a.gk_proj[1].bias.detach()).to(self.device,
                                                                                                  self.state_dtype)
        return GLAMixer(project=project, conv_w=act(torch.cat([c.weight[:, 0] for c in conv])) if conv else None,
                        conv_b=act(torch.cat([c.bias for c in conv])) if conv and conv[0].bias is not None else None,
                        b_gk=b_gk, normalizer=float(a.gate_logit_normalizer), clamp_min=a.clamp_min,
                        feature_map=feature_map, H=H, groups=a.num_kv_groups, K=a.head_k_dim, V=V, output=output,
                        dtype=self.dtype, state_dtype=self.state_dtype, device=self.device)

    def _block(self, li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """FLA's ``GLABlock``: pre-norm, mixer, residual; pre-norm, SwiGLU MLP, residual."""
        attn_w, attn_eps, mlp_w, mlp_eps, w_gate, w_up, w_down = self.blocks[li]
        x = x + mix(rms_norm(x, attn_w, attn_eps))
        h = rms_norm(x, mlp_w, mlp_eps)
        return x + (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
