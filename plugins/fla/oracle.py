"""Plain autoregressive decoding of an FLA ``GatedDeltaNetForCausalLM`` with the sequential GDN
recurrence (:func:`specla.mixers.gdn.naive.gdn_step`), one token at a time through every layer:
the plugin's ``reference_decode``, the oracle its speculative runs are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.fla_attention import is_fla_attention, naive_fla_attention
from specla.mixers.gdn.naive import gdn_step
from specla.ops.naive import naive_rms_norm
from specla.testing.stepwise import stepwise_greedy


class NaiveGDN:
    """Plain autoregressive decoding of an FLA ``GatedDeltaNetForCausalLM``, one token per step
    through every layer with the sequential recurrence (no trees, no factors, no batching).

    Reads the model's weights; its Triton forward is not used. State: ``states[l]``
    ``[HV, K, V]`` (float32, float64 for float64 models) and ``inputs[l]``, every pre-conv
    projection so far (the conv window is its last ``C - 1`` rows).

    Args:
        model: the transformers/FLA model.
    """

    def __init__(self, model):
        self.model = model
        self.dt = model.lm_head.weight.dtype
        self.ct = torch.float64 if self.dt == torch.float64 else torch.float32
        attns = [blk.attn for blk in model.model.layers]
        self.states = [torch.zeros(a.num_v_heads, a.head_k_dim, a.head_v_dim, dtype=self.ct) if not is_fla_attention(a)
                       else None for a in attns]
        self.inputs: list[list[Tensor]] = [[] for _ in attns]  # GDN layers: pre-conv inputs; attention: (k, v)

    def window(self, layer: int) -> Tensor:
        """``[C - 1, Dc]`` conv window of ``layer``: the last ``C - 1`` pre-conv inputs, zero-padded."""
        a = self.model.model.layers[layer].attn
        C = a.q_conv1d.weight.shape[-1]
        Dc = 2 * a.key_dim + a.value_dim
        hist = [torch.zeros(Dc, dtype=self.dt)] * (C - 1) + self.inputs[layer]
        return torch.stack(hist[len(hist) - (C - 1):])

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        """Feed one token; return the next-token logits ``[vocab]``."""
        m, dt, ct = self.model.model, self.dt, self.ct
        x = m.embeddings.weight[token]
        for li, blk in enumerate(m.layers):
            a = blk.attn
            h = naive_rms_norm(x, blk.attn_norm.weight, blk.attn_norm.eps).to(dt)
            if self.states[li] is None:  # a softmax-attention layer of FLA's hybrid configs
                x = self._mlp(blk, x + naive_fla_attention(a, h, self.inputs[li], ct))
                continue
            proj = torch.cat([h @ a.q_proj.weight.T, h @ a.k_proj.weight.T, h @ a.v_proj.weight.T])
            self.inputs[li].append(proj)
            if a.use_short_conv:
                convs = [a.q_conv1d, a.k_conv1d, a.v_conv1d]
                w = torch.cat([c.weight for c in convs])[:, 0].to(ct)  # [Dc, C]
                C = w.shape[1]
                hist = ([torch.zeros_like(proj)] * C + self.inputs[li])[-C:]
                pre = (torch.stack(hist).to(ct).T * w).sum(-1)
                if convs[0].bias is not None:
                    pre = pre + torch.cat([c.bias for c in convs]).to(ct)
                qkv = F.silu(pre).to(dt)
            else:
                qkv = F.silu(proj.to(ct)).to(dt)
            q, k, v = qkv.split([a.key_dim, a.key_dim, a.value_dim])
            # FLA's in-kernel l2norm: x / sqrt(sum(x^2) + 1e-6)
            q, k = (t.view(a.num_heads, -1).to(ct) for t in (q, k))
            q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
            v = v.view(a.num_v_heads, -1).to(ct)
            g = -torch.exp(a.A_log.to(ct)) * F.softplus((h @ a.a_proj.weight.T).to(ct) + a.dt_bias.to(ct))
            beta = torch.sigmoid((h @ a.b_proj.weight.T).to(ct)) * (2 if a.allow_neg_eigval else 1)
            o = torch.zeros(a.num_v_heads, a.head_v_dim, dtype=ct)
            grp = a.num_v_heads // a.num_heads
            for hv in range(a.num_v_heads):
                self.states[li][hv], o[hv], _ = gdn_step(
                    self.states[li][hv], q[hv // grp], k[hv // grp], v[hv], g[hv], beta[hv], a.head_k_dim**-0.5
                )
            o = naive_rms_norm(o, a.o_norm.weight, a.o_norm.eps)
            if a.use_gate:
                gate = (h @ a.g_proj.weight.T).view(a.num_v_heads, -1).to(ct)
                o = o * (torch.sigmoid(gate) if a.o_norm.activation == "sigmoid" else F.silu(gate))
            x = x + (o.reshape(-1).to(dt) @ a.o_proj.weight.T)
            x = self._mlp(blk, x)
        return naive_rms_norm(x, m.norm.weight, m.norm.eps).to(dt) @ self.model.lm_head.weight.T

    def _mlp(self, blk, x: Tensor) -> Tensor:
        """The block's pre-norm SwiGLU MLP and residual."""
        h = naive_rms_norm(x, blk.mlp_norm.weight, blk.mlp_norm.eps).to(self.dt)
        mlp = blk.mlp
        return x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def naive_greedy_decode(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy autoregressive decoding with :class:`NaiveGDN`; returns the new tokens only."""
    return stepwise_greedy(NaiveGDN(model).step, prompt, max_new_tokens)
