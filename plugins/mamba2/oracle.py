"""Plain autoregressive decoding of an FLA ``Mamba2ForCausalLM`` with the sequential SSD recurrence
(:func:`specla.mixers.mamba2.naive.ssd_step`), one token at a time through every layer: the
plugin's ``reference_decode``, the oracle its speculative runs are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.mixers.mamba2.naive import naive_gated_rms_norm, ssd_step
from specla.ops.naive import naive_rms_norm
from specla.testing.stepwise import stepwise_greedy


class NaiveMamba2:
    """Plain autoregressive decoding of an FLA ``Mamba2ForCausalLM``, one token per step through
    every layer with the sequential recurrence (no trees, no factors, no batching).

    Reads the model's weights; its forward is not used. State: ``states[l]`` ``[H, N, P]``
    (float32, float64 for float64 models) and ``inputs[l]``, every pre-conv ``xBC`` projection so
    far (the conv window is its last ``C - 1`` rows).

    Args:
        model: the transformers/FLA model.
    """

    def __init__(self, model):
        self.model = model
        self.dt = model.lm_head.weight.dtype
        self.ct = torch.float64 if self.dt == torch.float64 else torch.float32
        mixers = [blk.mixer for blk in model.backbone.layers]
        self.states = [torch.zeros(m.num_heads, m.ssm_state_size, m.head_dim, dtype=self.ct) for m in mixers]
        self.inputs: list[list[Tensor]] = [[] for _ in mixers]

    def window(self, layer: int) -> Tensor:
        """``[C - 1, Dc]`` conv window of ``layer``: the last ``C - 1`` pre-conv inputs, zero-padded."""
        m = self.model.backbone.layers[layer].mixer
        C = m.conv_kernel_size
        hist = [torch.zeros(m.conv_dim, dtype=self.dt)] * (C - 1) + self.inputs[layer]
        return torch.stack(hist[len(hist) - (C - 1):]) if C > 1 else torch.zeros(0, m.conv_dim, dtype=self.dt)

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        """Feed one token; return the next-token logits ``[vocab]``."""
        bb, dt, ct = self.model.backbone, self.dt, self.ct
        x = bb.embeddings.weight[token]
        for li, blk in enumerate(bb.layers):
            m = blk.mixer
            residual = x.to(torch.float32) if blk.residual_in_fp32 else x
            h = naive_rms_norm(x, blk.norm.weight, blk.norm.eps).to(dt)
            proj = h @ m.in_proj.weight.T
            if m.in_proj.bias is not None:
                proj = proj + m.in_proj.bias
            Di, H, P, N = m.intermediate_size, m.num_heads, m.head_dim, m.ssm_state_size
            z, xbc, dt_raw = proj.split([Di, m.conv_dim, H])
            self.inputs[li].append(xbc)
            C = m.conv_kernel_size
            hist = ([torch.zeros_like(xbc)] * C + self.inputs[li])[-C:]
            pre = (torch.stack(hist).to(ct).T * m.conv1d.weight[:, 0].to(ct)).sum(-1)
            if m.conv1d.bias is not None:
                pre = pre + m.conv1d.bias.to(ct)
            xbc = F.silu(pre).to(dt)
            xs, b, c = xbc.split([Di, m.n_groups * N, m.n_groups * N])
            xs, b, c = xs.view(H, P).to(ct), b.view(m.n_groups, N).to(ct), c.view(m.n_groups, N).to(ct)
            step = F.softplus(dt_raw.to(ct) + m.dt_bias.to(ct)).clamp(m.dt_limit[0], m.dt_limit[1])
            A = -torch.exp(m.A_log.to(ct))
            D = m.D.to(ct).view(H, P) if m.D_has_hdim else m.D.to(ct)
            grp = H // m.n_groups
            y = torch.zeros(H, P, dtype=ct)
            for hd in range(H):
                self.states[li][hd], y[hd] = ssd_step(self.states[li][hd], xs[hd], step[hd], A[hd],
                                                      b[hd // grp], c[hd // grp], D[hd])
            y = y.reshape(-1)
            if m.rmsnorm:
                o = naive_gated_rms_norm(y, z, m.norm.weight, m.norm.eps, m.norm.group_size, m.norm_before_gate)
            else:
                o = y * F.silu(z.to(ct))
            o = o.to(dt) @ m.out_proj.weight.T
            if m.out_proj.bias is not None:
                o = o + m.out_proj.bias
            x = (residual + o).to(dt)
        return naive_rms_norm(x, bb.norm_f.weight, bb.norm_f.eps).to(dt) @ self.model.lm_head.weight.T


def naive_greedy_decode(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy autoregressive decoding with :class:`NaiveMamba2`; returns the new tokens only."""
    return stepwise_greedy(NaiveMamba2(model).step, prompt, max_new_tokens)
