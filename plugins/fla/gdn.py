"""Describes an FLA ``GatedDeltaNetForCausalLM`` as a :class:`specla.model.spec.ModelSpec`.

FLA's modules are Triton-only, so they cannot serve CPU users: each block's sequence mixer is a
:class:`specla.mixers.gdn.mixer.GDNMixer` (its reference path in PyTorch, or the op's Triton kernels
with the fused delayed commit) built from the block's own weights: q/k/v/a/b/g projections,
tree-aware short convolution + SiLU, L2-normalised q/k, gates ``g = -exp(A_log) * softplus(a +
dt_bias)`` and ``beta = sigmoid(b)``, tree-masked GDN with factor records, gated RMSNorm. The block
around it (:func:`_block`): pre-norm, mixer, output projection and residual, then the
MLP; final norm and LM head. Where the kernels run, the block's input projections are one GEMM,
the norms and SwiGLU single Triton launches and both residual adds run inside their GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers import Mixer
from specla.mixers.gdn.mixer import GDNMixer
from specla.model.spec import ModelSpec, Placement, rms_head
from specla.ops import kernels
from specla.ops.norm import gated_rms_norm, rms_norm

from .attention import fla_attention_mixer, is_fla_attention

act_kernels = kernels("specla.ops.act_triton")
norm_kernels = kernels("specla.ops.norm_triton")


@dataclass
class _Block:
    """One GDN block's weights outside its mixer, converted once to the run's device and dtype."""

    attn_norm: Tensor
    attn_eps: float
    w_o: Tensor  # [hidden, HV * V]
    mlp_norm: Tensor
    mlp_eps: float
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    w_gu: Tensor | None  # [w_gate; w_up] stacked (one MLP input GEMM on the kernel path), else None


def gdn_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """FLA's Gated DeltaNet as a :class:`ModelSpec` (see the module docstring).

    State per sequence, per block: the :class:`GDNMixer` state, ``[B, HV, K, V]`` float32
    (float64 for float64 runs) and the conv window ``[B, C - 1, Dc]`` (none without short conv).
    Where the Triton kernels may run (without autograd) each block's input projections and MLP
    input projections are stacked into one weight each.

    Args:
        model: a ``fla.models.GatedDeltaNetForCausalLM`` (checked by the plugin), on the run's
            device and dtype.
        placement: the run's :class:`Placement`.
    """
    m, act = model.model, placement.act
    blocks, mixers = zip(*(_layer(blk, placement) for blk in m.layers))
    dtype = placement.dtype

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        return _block(blocks[li], x, mix, kernels, dtype)

    return ModelSpec(model=model, embed_weight=act(m.embeddings.weight),
                     logits=rms_head(placement, act(m.norm.weight), m.norm.eps, act(model.lm_head.weight)),
                     mixers=mixers, block=block, num_layers=len(mixers), eos_token_ids=eos_token_ids(model),
                     score_sequences=all(isinstance(mx, GDNMixer) for mx in mixers))


def _layer(blk: torch.nn.Module, placement: Placement) -> tuple[_Block, Mixer]:
    """One block's weights outside its mixer, and its mixer (FLA's attention in a hybrid)."""
    act, a = placement.act, blk.attn
    stacked = placement.triton_kernels and not placement.differentiable
    # the kernel path stacks the input projections into one GEMM each; the separate weights
    # are then row views of the stacks (no extra memory)
    mlp = [blk.mlp.gate_proj.weight, blk.mlp.up_proj.weight]
    I = mlp[0].shape[0]  # noqa: E741
    w_gu = act(torch.cat(mlp)) if stacked else None
    w_gate, w_up = (w_gu[:I], w_gu[I:]) if stacked else (act(mlp[0]), act(mlp[1]))
    block = _Block(attn_norm=act(blk.attn_norm.weight), attn_eps=blk.attn_norm.eps, w_o=act(a.o_proj.weight),
                   mlp_norm=act(blk.mlp_norm.weight), mlp_eps=blk.mlp_norm.eps, w_gate=w_gate, w_up=w_up,
                   w_down=act(blk.mlp.down_proj.weight), w_gu=w_gu)
    if is_fla_attention(a):  # a softmax-attention layer of FLA's hybrid configs (config.attn)
        return block, fla_attention_mixer(a, act, placement.dtype, placement.device, o_proj=False)
    conv = [a.q_conv1d, a.k_conv1d, a.v_conv1d] if a.use_short_conv else None
    ins = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.a_proj.weight, a.b_proj.weight]
    ins += [a.g_proj.weight] if a.use_gate else []
    HV, V, Dc = a.num_v_heads, a.head_v_dim, sum(w.shape[0] for w in ins[:3])
    if stacked:
        w_in = act(torch.cat(ins))
        w_qkv, w_a, w_b, w_g = w_in[:Dc], w_in[Dc:Dc + HV], w_in[Dc + HV:Dc + 2 * HV], w_in[Dc + 2 * HV:]
    else:
        w_in = None
        w_qkv, w_a, w_b, w_g = act(torch.cat(ins[:3])), act(ins[3]), act(ins[4]), act(ins[-1])
    w_g = w_g if a.use_gate else None
    o_norm, o_eps, gate_act = act(a.o_norm.weight), a.o_norm.eps, getattr(a.o_norm, "activation", "swish")
    dtype, state_dtype = placement.dtype, placement.state_dtype

    def project(h: Tensor, kernels: bool):
        if kernels and w_in is not None:  # one GEMM for every input projection
            z = h @ w_in.T
            return z[..., :Dc], z[..., Dc:Dc + HV], z[..., Dc + HV:Dc + 2 * HV], \
                (z[..., Dc + 2 * HV:] if w_g is not None else None)
        return h @ w_qkv.T, h @ w_a.T, h @ w_b.T, (h @ w_g.T if w_g is not None else None)

    def output(o: Tensor, z: Tensor | None, kernels: bool) -> Tensor:
        """The gated RMSNorm of ``o`` (``[B, T, HV, V]``), before the output projection, which
        :func:`_block` runs with the residual add."""
        B, T = o.shape[:2]
        og = z.reshape(B, T, HV, V) if z is not None else None
        if kernels:  # one Triton launch, out in the activation dtype
            return norm_kernels.rms_norm(o, o_norm, o_eps, og, gate_act, out_dtype=dtype)
        if og is not None:
            return gated_rms_norm(o, o_norm, o_eps, og, gate_act)
        return rms_norm(o, o_norm, o_eps).to(state_dtype)

    mixer = GDNMixer(project=project,
                     conv_w=act(torch.cat([c.weight[:, 0] for c in conv])) if conv else None,
                     conv_b=act(torch.cat([c.bias for c in conv])) if conv and conv[0].bias is not None else None,
                     A_log=placement.state(a.A_log), dt_bias=placement.state(a.dt_bias), H=a.num_heads, HV=HV,
                     K=a.head_k_dim, V=V, beta_scale=2.0 if a.allow_neg_eigval else 1.0, output=output, dtype=dtype,
                     state_dtype=state_dtype, device=placement.device)
    return block, mixer


def _block(L: _Block, x: Tensor, mix, kernels: bool, dtype: torch.dtype) -> Tensor:
    """FLA's ``GatedDeltaNetBlock``: pre-norm, mixer (its gated norm), output projection and
    residual; pre-norm, SwiGLU MLP, residual. ``kernels``: the norms and SwiGLU are single
    Triton launches, the MLP has one input GEMM (``w_gu``) and both residual adds run inside
    their GEMMs (in-place ``addmm_``)."""
    B, T = x.shape[:2]
    if kernels and L.w_gu is not None:
        o = mix(norm_kernels.rms_norm(x, L.attn_norm, L.attn_eps))
        # in-place addmm_ is one GEMM with beta = 1 (out of place it would copy x first); x is
        # this pass's own residual stream, held nowhere else
        x = x.reshape(B * T, -1).contiguous()
        x.addmm_(o.reshape(B * T, -1), L.w_o.T)
        gu = norm_kernels.rms_norm(x, L.mlp_norm, L.mlp_eps) @ L.w_gu.T
        x.addmm_(act_kernels.swiglu(gu, L.w_gate.shape[0]), L.w_down.T)
        return x.view(B, T, -1)
    o = mix(rms_norm(x, L.attn_norm, L.attn_eps))
    x = x + o.reshape(B, T, -1).to(dtype) @ L.w_o.T
    h = rms_norm(x, L.mlp_norm, L.mlp_eps)
    return x + (F.silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
