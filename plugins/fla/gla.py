"""Describes an FLA ``GLAForCausalLM`` as a :class:`specla.model.spec.ModelSpec`.

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

from specla.hf import eos_token_ids
from specla.mixers import Mixer
from specla.mixers.gla.mixer import GLAMixer
from specla.model.spec import ModelSpec, Placement, rms_head
from specla.ops.norm import rms_norm

from .attention import fla_attention_mixer, is_fla_attention

# feature maps FLA's GatedLinearAttention may apply to q and k (config.feature_map), in PyTorch
FEATURE_MAPS = {None: lambda x: x, "relu": F.relu, "sigmoid": torch.sigmoid, "swish": F.silu, "silu": F.silu}


def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm with an optional weight (``elementwise_affine=False`` has none)."""
    return rms_norm(x, weight if weight is not None else torch.ones((), dtype=x.dtype, device=x.device), eps)


def gla_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """FLA's GLA as a :class:`ModelSpec` (see the module docstring).

    State per sequence, per block: the :class:`GLAMixer` state, ``[B, H, K, V]`` float32 (float64
    for float64 runs) and the conv window ``[B, C - 1, Dc]`` (none without short conv).

    Args:
        model: a ``fla.models.GLAForCausalLM`` (checked by the plugin), on the run's device and
            dtype.
        placement: the run's :class:`Placement`.
    """
    m, act = model.model, placement.act
    feature_map = FEATURE_MAPS[model.config.feature_map]
    blocks = [(act(b.attn_norm.weight), b.attn_norm.eps, act(b.mlp_norm.weight), b.mlp_norm.eps,
               act(b.mlp.gate_proj.weight), act(b.mlp.up_proj.weight), act(b.mlp.down_proj.weight)) for b in m.layers]
    mixers = tuple(_mixer(b.attn, feature_map, placement) for b in m.layers)

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """FLA's ``GLABlock``: pre-norm, mixer, residual; pre-norm, SwiGLU MLP, residual."""
        attn_w, attn_eps, mlp_w, mlp_eps, w_gate, w_up, w_down = blocks[li]
        x = x + mix(rms_norm(x, attn_w, attn_eps))
        h = rms_norm(x, mlp_w, mlp_eps)
        return x + (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T

    return ModelSpec(model=model, embed_weight=act(m.embeddings.weight),
                     logits=rms_head(placement, act(m.norm.weight), m.norm.eps, act(model.lm_head.weight)),
                     mixers=mixers, block=block, num_layers=len(mixers), eos_token_ids=eos_token_ids(model))


def _mixer(a: torch.nn.Module, feature_map, placement: Placement) -> Mixer:
    act, dtype = placement.act, placement.dtype
    if is_fla_attention(a):  # a softmax-attention layer of FLA's hybrid configs (config.attn)
        return fla_attention_mixer(a, act, dtype, placement.device)
    conv = [a.q_conv1d, a.k_conv1d, a.v_conv1d] if a.use_short_conv else None
    onorm = a.g_norm_swish_gate if a.fuse_norm_and_gate else a.g_norm
    w_qkv = act(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    w_gk1, w_gk2 = act(a.gk_proj[0].weight), act(a.gk_proj[1].weight)
    w_g = act(a.g_proj.weight) if a.use_output_gate else None
    o_norm, o_eps, w_o = act(onorm.weight), onorm.eps, act(a.o_proj.weight)
    H, V = a.num_heads, a.head_v_dim

    def project(h: Tensor):
        return h @ w_qkv.T, (h @ w_gk1.T) @ w_gk2.T, (h @ w_g.T if w_g is not None else None)

    def output(o: Tensor, gate: Tensor | None) -> Tensor:
        B, T = o.shape[:2]
        o = _rms(o, o_norm, o_eps)
        if gate is not None:  # FusedRMSNormGated(swish), or g_norm then gate_fn = swish
            o = o * F.silu(gate.view(B, T, H, V).to(o.dtype))
        return o.reshape(B, T, -1).to(dtype) @ w_o.T

    return GLAMixer(project=project, conv_w=act(torch.cat([c.weight[:, 0] for c in conv])) if conv else None,
                    conv_b=act(torch.cat([c.bias for c in conv])) if conv and conv[0].bias is not None else None,
                    b_gk=placement.state(a.gk_proj[1].bias), normalizer=float(a.gate_logit_normalizer),
                    clamp_min=a.clamp_min, feature_map=feature_map, H=H, groups=a.num_kv_groups, K=a.head_k_dim, V=V,
                    output=output, dtype=dtype, state_dtype=placement.state_dtype, device=placement.device)
