"""Plain autoregressive decoding of FLA's ``GatedDeltaNetForCausalLM``, ``GLAForCausalLM`` and
``Mamba2ForCausalLM``, one token at a time through every layer with the sequential recurrences
(:func:`specla.mixers.gdn.naive.gdn_step`, :func:`specla.mixers.gla.naive.gla_step`,
:func:`specla.mixers.mamba2.naive.ssd_step`): the plugins' ``reference_decode``, the oracle their
speculative runs are tested against. The walkers read the models' weights; FLA's Triton forward
is not used. GLA's layer follows ``fla/layers/gla.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.mixers.gdn.naive import gdn_step
from specla.mixers.gla.naive import gla_step
from specla.mixers.mamba2.naive import naive_gated_rms_norm, ssd_step
from specla.ops.naive import naive_rms_norm
from specla.testing.stepwise import stepwise_greedy

from .attention import is_fla_attention, naive_fla_attention
from .gla import FEATURE_MAPS


class _Walker:
    """What the walkers share: the model's activation dtype ``dt`` and compute dtype ``ct``
    (float64 for float64 models, else float32), per layer the recurrent state ``states[l]``
    (``None`` for a softmax-attention layer) and ``inputs[l]``, every pre-conv projection so far
    (the conv window is its last ``C - 1`` rows; an attention layer's ``(k, v)`` cache).

    Args:
        model: the FLA model.
        state_shapes: per layer, the shape of its state, or ``None`` for an attention layer.
    """

    def __init__(self, model, state_shapes: list[tuple[int, ...] | None]):
        self.model = model
        self.dt = model.lm_head.weight.dtype
        self.ct = torch.float64 if self.dt == torch.float64 else torch.float32
        self.states = [torch.zeros(s, dtype=self.ct) if s is not None else None for s in state_shapes]
        self.inputs: list[list[Tensor]] = [[] for _ in state_shapes]

    def conv_shape(self, layer: int) -> tuple[int, int]:
        """``(C, Dc)``: the conv width and channels of ``layer``."""
        raise NotImplementedError

    def window(self, layer: int) -> Tensor:
        """``[C - 1, Dc]`` conv window of ``layer``: the last ``C - 1`` pre-conv inputs, zero-padded."""
        C, Dc = self.conv_shape(layer)
        hist = [torch.zeros(Dc, dtype=self.dt)] * (C - 1) + self.inputs[layer]
        return torch.stack(hist[len(hist) - (C - 1):]) if C > 1 else torch.zeros(0, Dc, dtype=self.dt)

    def short_conv(self, layer: int, weight: Tensor, bias: Tensor | None) -> Tensor:
        """SiLU of the causal depthwise conv over ``layer``'s last ``C`` inputs (zeros before the
        first), summed in ``ct``, in ``dt``. ``weight``: ``[Dc, C]``; ``bias``: ``[Dc]`` or ``None``."""
        C = weight.shape[1]
        hist = ([torch.zeros_like(self.inputs[layer][-1])] * C + self.inputs[layer])[-C:]
        pre = (torch.stack(hist).to(self.ct).T * weight.to(self.ct)).sum(-1)
        if bias is not None:
            pre = pre + bias.to(self.ct)
        return F.silu(pre).to(self.dt)

    def logits(self, x: Tensor, norm: torch.nn.Module) -> Tensor:
        """``[vocab]``: the final RMSNorm, then the LM head."""
        return naive_rms_norm(x, norm.weight, norm.eps).to(self.dt) @ self.model.lm_head.weight.T


class _GatedMLPWalker(_Walker):
    """FLA's GDN and GLA models: per block a pre-norm mixer (the recurrence, or a hybrid config's
    softmax attention) with its residual, then a pre-norm SwiGLU MLP with its residual."""

    def __init__(self, model):
        attns = [blk.attn for blk in model.model.layers]
        super().__init__(model, [None if is_fla_attention(a) else self.state_shape(a) for a in attns])

    def state_shape(self, a: torch.nn.Module) -> tuple[int, ...]:
        raise NotImplementedError

    def mix(self, layer: int, a: torch.nn.Module, h: Tensor) -> Tensor:
        """``[hidden]``: the recurrent layer ``a``'s output, its output projection included, for
        the normed input ``h`` ``[hidden]``; advances ``states[layer]`` and ``inputs[layer]``."""
        raise NotImplementedError

    def conv_shape(self, layer: int) -> tuple[int, int]:
        a = self.model.model.layers[layer].attn
        return a.q_conv1d.weight.shape[-1], sum(c.weight.shape[0] for c in (a.q_conv1d, a.k_conv1d, a.v_conv1d))

    def qkv(self, layer: int, a: torch.nn.Module, h: Tensor) -> Tensor:
        """The q/k/v projections of ``h``, appended to ``inputs[layer]``, through the layer's
        short conv + SiLU (FLA's ``ShortConvolution(activation="silu")`` on q, k, v); without a
        short conv, the projections as they are."""
        proj = torch.cat([h @ a.q_proj.weight.T, h @ a.k_proj.weight.T, h @ a.v_proj.weight.T])
        self.inputs[layer].append(proj)
        if not a.use_short_conv:
            return proj
        convs = [a.q_conv1d, a.k_conv1d, a.v_conv1d]
        bias = torch.cat([c.bias for c in convs]) if convs[0].bias is not None else None
        return self.short_conv(layer, torch.cat([c.weight for c in convs])[:, 0], bias)

    @torch.no_grad()
    def step(self, token: int) -> Tensor:
        """Feed one token; return the next-token logits ``[vocab]``."""
        m = self.model.model
        x = m.embeddings.weight[token]
        for li, blk in enumerate(m.layers):
            a = blk.attn
            h = naive_rms_norm(x, blk.attn_norm.weight, blk.attn_norm.eps).to(self.dt)
            if self.states[li] is None:  # a softmax-attention layer of FLA's hybrid configs
                x = x + naive_fla_attention(a, h, self.inputs[li], self.ct)
            else:
                x = x + self.mix(li, a, h)
            h = naive_rms_norm(x, blk.mlp_norm.weight, blk.mlp_norm.eps).to(self.dt)
            mlp = blk.mlp
            x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        return self.logits(x, m.norm)


class NaiveGDN(_GatedMLPWalker):
    """FLA's ``GatedDeltaNetForCausalLM`` one token per step (no trees, no factors, no batching).
    State: ``states[l]`` ``[HV, K, V]``."""

    def state_shape(self, a: torch.nn.Module) -> tuple[int, ...]:
        return a.num_v_heads, a.head_k_dim, a.head_v_dim

    def mix(self, layer: int, a: torch.nn.Module, h: Tensor) -> Tensor:
        ct = self.ct
        qkv = self.qkv(layer, a, h)
        if not a.use_short_conv:  # FLA applies the SiLU without a conv too
            qkv = F.silu(qkv.to(ct)).to(self.dt)
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
            self.states[layer][hv], o[hv], _ = gdn_step(
                self.states[layer][hv], q[hv // grp], k[hv // grp], v[hv], g[hv], beta[hv], a.head_k_dim**-0.5
            )
        o = naive_rms_norm(o, a.o_norm.weight, a.o_norm.eps)
        if a.use_gate:
            gate = (h @ a.g_proj.weight.T).view(a.num_v_heads, -1).to(ct)
            o = o * (torch.sigmoid(gate) if a.o_norm.activation == "sigmoid" else F.silu(gate))
        return o.reshape(-1).to(self.dt) @ a.o_proj.weight.T


class NaiveGLA(_GatedMLPWalker):
    """FLA's ``GLAForCausalLM`` one token per step (no trees, no factors, no batching). State:
    ``states[l]`` ``[H, K, V]``, key/value heads repeated to the ``H`` query heads as FLA's layer
    does."""

    def state_shape(self, a: torch.nn.Module) -> tuple[int, ...]:
        return a.num_heads, a.head_k_dim, a.head_v_dim

    def mix(self, layer: int, a: torch.nn.Module, h: Tensor) -> Tensor:
        ct = self.ct
        q, k, v = self.qkv(layer, a, h).split([a.key_dim, a.key_dim_per_group, a.value_dim_per_group])
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
            self.states[layer][hh], o[hh] = gla_step(self.states[layer][hh], q[hh], k[hh], v[hh], gk[hh],
                                                     a.head_k_dim**-0.5)
        norm = a.g_norm_swish_gate if a.fuse_norm_and_gate else a.g_norm
        o = naive_rms_norm(o, norm.weight, norm.eps)
        if a.use_output_gate:  # FusedRMSNormGated(swish) or g_norm then gate_fn = swish
            o = o * F.silu((h @ a.g_proj.weight.T).view(H, -1).to(ct))
        return o.reshape(-1).to(self.dt) @ a.o_proj.weight.T


class NaiveMamba2(_Walker):
    """FLA's ``Mamba2ForCausalLM`` one token per step (no trees, no factors, no batching). State:
    ``states[l]`` ``[H, N, P]``; ``inputs[l]`` holds the pre-conv ``xBC`` projections."""

    def __init__(self, model):
        super().__init__(model, [(blk.mixer.num_heads, blk.mixer.ssm_state_size, blk.mixer.head_dim)
                                 for blk in model.backbone.layers])

    def conv_shape(self, layer: int) -> tuple[int, int]:
        m = self.model.backbone.layers[layer].mixer
        return m.conv_kernel_size, m.conv_dim

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
            xbc = self.short_conv(li, m.conv1d.weight[:, 0], m.conv1d.bias)
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
        return self.logits(x, bb.norm_f)


# the walker of each FLA model type
WALKERS = {"gated_deltanet": NaiveGDN, "gla": NaiveGLA, "mamba2": NaiveMamba2}


def naive_greedy_decode(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy autoregressive decoding with the walker of ``model``'s ``config.model_type``
    (:data:`WALKERS`); returns the new tokens only.

    Raises:
        KeyError: not one of FLA's ``gated_deltanet``, ``gla`` or ``mamba2`` models.
    """
    return stepwise_greedy(WALKERS[model.config.model_type](model).step, prompt, max_new_tokens)
