"""Describes an FLA ``Mamba2ForCausalLM`` as a :class:`specla.model.spec.ModelSpec`.

FLA's cached path takes one new token per step, so tree verify is specla's: each block's
sequence mixer is a :class:`specla.mixers.mamba2.mixer.Mamba2Mixer` (tree-aware conv, tree-masked SSD,
factor/snapshot/replay records; its reference path in PyTorch, or the op's Triton kernels with
the fused delayed commit when ``SpecConfig.engine.kernels`` allows), built from the block's own weights.
The block around it follows FLA's ``Mamba2Block``: RMSNorm, mixer (``in_proj`` split into ``z, xBC,
dt``; gated RMSNorm with ``z``, or ``y * silu(z)`` without it; ``out_proj``), residual (added in
float32 with ``residual_in_fp32``); then ``norm_f`` and the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers.mamba2.mixer import Mamba2Mixer
from specla.mixers.mamba2.reference import gated_rms_norm
from specla.model.spec import ModelSpec, Placement, rms_head
from specla.ops.norm import rms_norm


def mamba2_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """FLA's ``Mamba2ForCausalLM`` as a :class:`ModelSpec` (see the module docstring).

    State per sequence, per block: the :class:`Mamba2Mixer` state, ``[B, H, N, P]`` float32
    (float64 for float64 runs) and the conv window ``[B, C - 1, Dc]`` in the activation dtype.

    Args:
        model: a ``fla.models.Mamba2ForCausalLM`` (checked by the plugin), on the run's device and
            dtype.
        placement: the run's :class:`Placement`.
    """
    bb, act, dtype = model.backbone, placement.act, placement.dtype
    blocks = [(act(blk.norm.weight), blk.norm.eps, blk.residual_in_fp32) for blk in bb.layers]
    mixers = tuple(_mixer(blk.mixer, placement) for blk in bb.layers)

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """FLA's ``Mamba2Block``: RMSNorm, the mixer, the residual add (in float32 with
        ``residual_in_fp32``)."""
        w, eps, fp32 = blocks[li]
        residual = x.float() if fp32 else x
        return (residual + mix(rms_norm(x, w, eps))).to(dtype)

    return ModelSpec(model=model, embed_weight=act(bb.embeddings.weight),
                     logits=rms_head(placement, act(bb.norm_f.weight), bb.norm_f.eps, act(model.lm_head.weight)),
                     mixers=mixers, block=block, num_layers=len(mixers), eos_token_ids=eos_token_ids(model))


def _mixer(m: torch.nn.Module, placement: Placement) -> Mamba2Mixer:
    act, st, dtype = placement.act, placement.state, placement.dtype
    Di, Dc, H = m.num_heads * m.head_dim, m.conv_dim, m.num_heads
    w_in, b_in, w_out, b_out = (act(p) for p in (m.in_proj.weight, m.in_proj.bias, m.out_proj.weight,
                                                 m.out_proj.bias))
    gnorm = act(m.norm.weight) if m.rmsnorm else None
    gnorm_eps, group, before = (m.norm.eps, m.norm.group_size, m.norm_before_gate) if m.rmsnorm else (0, 0, False)

    def project(h: Tensor):
        return F.linear(h, w_in, b_in).split([Di, Dc, H], dim=-1)

    def output(y: Tensor, z: Tensor) -> Tensor:
        o = gated_rms_norm(y, z, gnorm, gnorm_eps, group, before) if gnorm is not None else y * F.silu(z.to(y.dtype))
        return F.linear(o.to(dtype), w_out, b_out)

    return Mamba2Mixer(project=project, conv_w=act(m.conv1d.weight[:, 0]), conv_b=act(m.conv1d.bias),
                       A_log=st(m.A_log), dt_bias=st(m.dt_bias), D=st(m.D).view(H, m.head_dim) if m.D_has_hdim else st(m.D),
                       dt_limit=tuple(float(v) for v in m.dt_limit), H=H, P=m.head_dim, N=m.ssm_state_size,
                       G=m.n_groups, output=output, dtype=dtype, state_dtype=placement.state_dtype,
                       device=placement.device)
