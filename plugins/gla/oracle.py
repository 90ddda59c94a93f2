"""Plain autoregressive decoding of an FLA ``GLAForCausalLM`` with the sequential GLA recurrence
(:func:`specla.mixers.gla.naive.gla_step`), one token at a time through every layer: the plugin's
``reference_decode``, the oracle its speculative runs are tested against. The layer follows
``fla/layers/gla.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.fla_attention import is_fla_attention, naive_fla_attention
from specla.mixers.gla.naive import gla_step
from specla.ops.naive import naive_rms_norm
from specla.testing.stepwise import stepwise_greedy

from .plugin import FEATURE_MAPS


class NaiveGLA:
    """Plain autoregressive decoding of an FLA ``GLAForCausalLM``, one token per step through every
    layer with the sequential recurrence (no trees, no factors, no batching).

    Reads the model's weights; its Triton forward is not used. State: ``states[l]`` ``[H, K, V]``
    (float32, float64 for float64 models; key/value heads repeated to the ``H`` query heads as
    FLA's layer does) and ``inputs[l]``, every pre-conv projection so far (the conv window is its
    last ``C - 1`` rows).

    Args:
        model: the transformers/FLA model.
    """

    def __init__(self, model):
        self.model = model
        self.dt = model.lm_head.weight.dtype
        self.ct = torch.float64 if self.dt == torch.float64 else torch.float32
        attns = [blk.attn for blk in model.model.layers]
        self.states = [torch.zeros(a.num_heads, a.head_k_dim, a.head_v_dim, dtype=self.ct) if not is_fla_attention(a)
                       else None for a in attns]
        self.inputs: list[list[Tensor]] = [[] for _ in attns]  # GLA layers: pre-conv inputs; attention: (k, v)

    def window(self, layer: int) -> Tensor:
        """``[C - 1, Dc]`` conv window of ``layer``: the last ``C - 1`` pre-conv inputs, zero-padded."""
        a = self.model.model.layers[layer].attn
        C = a.q_conv1d.weight.shape[-1]
        Dc = a.key_dim + a.key_dim_per_group + a.value_dim_per_group
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
            if a.use_short_conv:  # ShortConvolution(activation="silu") on q, k, v separately
                convs = [a.q_conv1d, a.k_conv1d, a.v_conv1d]
                w = torch.cat([c.weight for c in convs])[:, 0].to(ct)  # [Dc, C]
                C = w.shape[1]
                hist = ([torch.zeros_like(proj)] * C + self.inputs[li])[-C:]
                pre = (torch.stack(hist).to(ct).T * w).sum(-1)
                if convs[0].bias is not None:
                    pre = pre + torch.cat([c.bias for c in convs]).to(ct)
                qkv = F.silu(pre).to(dt)
            else:
                qkv = proj
            q, k, v = qkv.split([a.key_dim, a.key_dim_per_group, a.value_dim_per_group])
            gk = (h @ a.gk_proj[0].weight.T) @ a.gk_proj[1].weight.T + a.gk_proj[1].bias
            H, grp = a.num_heads, a.num_kv_groups
            q = q.view(H, -1).to(ct)
            # num_kv_heads < num_heads: kv head i serves query heads i*grp .. i*grp+grp-1 (FLA repeat)
            k, v, gk = (t.view(H // grp, -1).repeat_interleave(grp, 0).to(ct) for t in (k, v, gk))
            gk = F.logsigmoid(gk) / a.gate_logit_normalizer
            if a.clamp_min is not None:
                gk = gk.clamp_min(a.clamp_min)
            fmap = FEATURE_MAPS[self.model.config.feature_map]
            q, k = fmap(q), fmap(k)
            o = torch.zeros(H, a.head_v_dim, dtype=ct)
            for hh in range(H):
                self.states[li][hh], o[hh] = gla_step(self.states[li][hh], q[hh], k[hh], v[hh], gk[hh],
                                                      a.head_k_dim**-0.5)
            norm = a.g_norm_swish_gate if a.fuse_norm_and_gate else a.g_norm
            o = naive_rms_norm(o, norm.weight, norm.eps)
            if a.use_output_gate:  # FusedRMSNormGated(swish) or g_norm then gate_fn = swish
                o = o * F.silu((h @ a.g_proj.weight.T).view(H, -1).to(ct))
            x = x + (o.reshape(-1).to(dt) @ a.o_proj.weight.T)
            x = self._mlp(blk, x)
        return naive_rms_norm(x, m.norm.weight, m.norm.eps).to(dt) @ self.model.lm_head.weight.T

    def _mlp(self, blk, x: Tensor) -> Tensor:
        """The block's pre-norm SwiGLU MLP and residual."""
        h = naive_rms_norm(x, blk.mlp_norm.weight, blk.mlp_norm.eps).to(self.dt)
        mlp = blk.mlp
        return x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def naive_greedy_decode(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy autoregressive decoding with :class:`NaiveGLA`; returns the new tokens only."""
    return stepwise_greedy(NaiveGLA(model).step, prompt, max_new_tokens)
