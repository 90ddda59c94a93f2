"""Turns an FLA ``Mamba2ForCausalLM`` into a :class:`specla.TargetAdapter` on the mixer core.

FLA's cached path takes one new token per step, so tree verify is specla's: each block's
sequence mixer is a :class:`specla.mixers.mamba2.mixer.Mamba2Mixer` (tree-aware conv, tree-masked SSD,
factor/snapshot/replay records; its reference path in PyTorch, or the op's Triton kernels with
the fused delayed commit when ``SpecConfig.kernels`` allows), built from the block's own weights.
The block around it follows FLA's ``Mamba2Block``: RMSNorm, mixer (``in_proj`` split into ``z, xBC,
dt``; gated RMSNorm with ``z``, or ``y * silu(z)`` without it; ``out_proj``), residual (added in
float32 with ``residual_in_fp32``); then ``norm_f`` and the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.config import SpecConfig
from specla.mixers import MixerAdapter
from specla.mixers.mamba2.mixer import Mamba2Mixer
from specla.mixers.mamba2.reference import gated_rms_norm
from specla.ops.norm import rms_norm


class Mamba2Adapter(MixerAdapter):
    """FLA's ``Mamba2ForCausalLM`` on the mixer core (see the module docstring).

    State per sequence, per block: the :class:`Mamba2Mixer` state, ``[B, H, N, P]`` float32
    (float64 for float64 runs) and the conv window ``[B, C - 1, Dc]`` in the activation dtype.
    Weights are read from ``model`` once; ``model`` itself is not modified.

    Args:
        model: a ``fla.models.Mamba2ForCausalLM`` (checked by the plugin).
        config: the run's :class:`SpecConfig` (``dtype``/``device`` override the model's).
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig):
        self._place(config, model.lm_head.weight)
        bb = model.backbone
        self._copy_head(model, bb.embeddings, bb.norm_f)
        self.blocks = [(self._act(blk.norm.weight), blk.norm.eps, blk.residual_in_fp32) for blk in bb.layers]
        self.mixers = [self._mixer(blk.mixer) for blk in bb.layers]
        self.num_layers = len(self.mixers)
        self._init_state()

    def _mixer(self, m: torch.nn.Module) -> Mamba2Mixer:
        st = lambda p: p.detach().to(self.device, self.state_dtype)  # noqa: E731
        Di, Dc, H = m.num_heads * m.head_dim, m.conv_dim, m.num_heads
        w_in, b_in, w_out, b_out = (self._act(p) for p in (m.in_proj.weight, m.in_proj.bias, m.out_proj.weight,
                                                             m.out_proj.bias))
        gnorm = self._act(m.norm.weight) if m.rmsnorm else None
        gnorm_eps, group, before = (m.norm.eps, m.norm.group_size, m.norm_before_gate) if m.rmsnorm else (0, 0, False)
        dtype = self.dtype  # a value, not self, in the mixer's closures (see LayerwiseAdapter)

        def project(h: Tensor):
            return F.linear(h, w_in, b_in).split([Di, Dc, H], dim=-1)

        def output(y: Tensor, z: Tensor) -> Tensor:
            o = gated_rms_norm(y, z, gnorm, gnorm_eps, group, before) if gnorm is not None else y * F.silu(z.to(y.dtype))
            return F.linear(o.to(dtype), w_out, b_out)

        return Mamba2Mixer(project=project, conv_w=self._act(m.conv1d.weight[:, 0]), conv_b=self._act(m.conv1d.bias),
                           A_log=st(m.A_log), dt_bias=st(m.dt_bias), D=st(m.D).view(H, m.head_dim) if m.D_has_hdim else st(m.D),
                           dt_limit=tuple(float(v) for v in m.dt_limit), H=H, P=m.head_dim, N=m.ssm_state_size,
                           G=m.n_groups, output=output, dtype=self.dtype, state_dtype=self.state_dtype,
                           device=self.device)

    def _block(self, li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """FLA's ``Mamba2Block``: RMSNorm, the mixer, the residual add (in float32 with
        ``residual_in_fp32``)."""
        w, eps, fp32 = self.blocks[li]
        residual = x.float() if fp32 else x
        return (residual + mix(rms_norm(x, w, eps))).to(self.dtype)
