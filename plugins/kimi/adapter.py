"""Turns transformers' ``KimiLinearForCausalLM`` into a :class:`specla.TargetAdapter` on the mixer
core.

Kimi Linear interleaves Kimi Delta Attention (KDA: a gated delta rule whose decay is per key
channel, with a short convolution over q, k, v) with multi-head latent attention (MLA) without
positional encoding. :class:`KDAMixer` verifies a draft tree in one factorized pass
(:func:`specla_kimi.reference.tree_kda`: every node's output and delta as if the recurrence ran
along its root path) and commits the accepted path from compact per-token factor records ``(k,
delta, Gk)`` in closed form (``factor``), from per-node states (``snapshot``) or by running its
tokens again (``replay``); :class:`MLAMixer` runs the core's tree attention in MLA's latent
space over a KV cache of the latents (one head of ``kv_lora_rank + qk_rope_head_dim``). The
checkpoint's own modules do everything else (projections, gates, norms, MLP / MoE, LM head).
PyTorch only: no Triton kernels for KDA yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from specla.config import SpecConfig
from specla.layerwise import eos_token_ids
from specla.fla_attention import fla_installed
from specla.mixers import AttentionMixer, MixerAdapter, RecurrentMixer, TreePass
from specla.ops.conv import conv_window_after, conv_windows_per_node, tree_conv
from specla.records import Record, take_accepted

from .naive import kda_commit_replay
from .reference import kda_commit_factor, kda_node_states, tree_kda


@dataclass(frozen=True)
class KDAFactorRecord(Record):
    """The ``factor`` strategy: what the closed-form commit needs per node
    (:func:`specla_kimi.reference.kda_commit_factor`)."""

    k: Tensor  # [B, T, H, K] state dtype, L2-normalised
    delta: Tensor  # [B, T, H, V] state dtype, the delta rule's write on the node's root path
    Gk: Tensor  # [B, T, H, K] state dtype, per-channel log decay summed along the root path
    conv_x: Tensor  # [B, T, 3 H D] activation dtype, the conv inputs


@dataclass(frozen=True)
class KDAReplayRecord(Record):
    """The ``replay`` strategy: the per-token inputs the commit runs again."""

    k: Tensor  # [B, T, H, K] state dtype, L2-normalised
    v: Tensor  # [B, T, H, V] state dtype
    g: Tensor  # [B, T, H, K] state dtype, per-channel log decay
    beta: Tensor  # [B, T, H] state dtype
    conv_x: Tensor  # [B, T, 3 H D] activation dtype, the conv inputs


@dataclass(frozen=True)
class KDASnapshotRecord(Record):
    """The snapshot strategy: the state and the conv window after every node."""

    states: Tensor  # [B, T, H, K, V] state dtype
    conv_windows: Tensor  # [B, T, C - 1, 3 H D] activation dtype


class KDAMixer(RecurrentMixer):
    """One Kimi Delta Attention layer (``KimiLinearDeltaAttention``) under draft trees: ``q, k, v``
    projections through a tree-aware short convolution + SiLU, the layer's forget gate (per-channel
    log decay) and ``beta = sigmoid(b_proj h)``, q and k L2-normalised (transformers' ``l2norm``)
    and q scaled by ``K ** -0.5``, the recurrence along each root path, then the layer's gated
    RMSNorm and output projection.

    State: ``S [B, H, K, V]`` in ``state_dtype`` and the conv window ``[B, C - 1, 3 H D]``.

    Args:
        layer: the layer's ``KimiLinearDeltaAttention`` module.
        dtype, state_dtype, device: activations, recurrent state, device.
    """

    def __init__(self, layer: torch.nn.Module, dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device):
        self.m, self.dtype, self.state_dtype, self.device = layer, dtype, state_dtype, device
        self.H, self.D = layer.num_heads, layer.head_dim
        self.conv_w = layer.conv1d.weight.detach()[:, 0]
        self.conv_b = layer.conv1d.bias.detach() if layer.conv1d.bias is not None else None
        self.C = self.conv_w.shape[1]
        self.l2norm = sys.modules[type(layer).__module__].l2norm
        self.empty_state(0, 0)

    def empty_record(self, B: int, T: int) -> KDAFactorRecord:
        z = lambda *s, dtype=self.state_dtype: torch.zeros(B, T, *s, dtype=dtype, device=self.device)  # noqa: E731
        H, D = self.H, self.D
        return KDAFactorRecord(k=z(H, D), delta=z(H, D), Gk=z(H, D), conv_x=z(3 * H * D, dtype=self.dtype))

    def empty_state(self, B: int, capacity: int) -> None:
        self.S = torch.zeros(B, self.H, self.D, self.D, dtype=self.state_dtype, device=self.device)
        self.conv = torch.zeros(B, self.C - 1, 3 * self.H * self.D, dtype=self.dtype, device=self.device)

    def verify(self, h: Tensor, tp: TreePass, pending: Record | None) -> tuple[Tensor, Record]:
        if pending is not None:  # the delayed commit of the previous step
            self.commit(pending, tp.path, tp.path_len, False)
        m, (B, T), H, D, st = self.m, h.shape[:2], self.H, self.D, self.state_dtype
        mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], -1)
        anc = tp.conv_ancestors(self.C)
        q, k, v = tree_conv(mixed, self.conv, self.conv_w, self.conv_b, anc).split(H * D, dim=-1)
        # float32 (or wider) from here, as transformers' KDA: norms, decays and the state
        q = self.l2norm(q.reshape(B, T, H, D).to(st), dim=-1, eps=1e-6) * D**-0.5
        k = self.l2norm(k.reshape(B, T, H, D).to(st), dim=-1, eps=1e-6)
        v = v.reshape(B, T, H, D).to(st)
        g, beta = m.forget_gate(h).to(st), torch.sigmoid(m.b_proj(h)).to(st)
        o, delta, Gk = tree_kda(q, k, v, g, beta, self.S, tp.mask)
        if tp.records == "factor":
            rec = KDAFactorRecord(k=k, delta=delta, Gk=Gk, conv_x=mixed)
        elif tp.records == "snapshot":
            rec = KDASnapshotRecord(kda_node_states(self.S, k, delta, Gk, tp.mask),
                                    conv_windows_per_node(mixed, self.conv, anc))
        else:
            rec = KDAReplayRecord(k=k, v=v, g=g, beta=beta, conv_x=mixed)
        gate = m.g_b_proj(m.g_a_proj(h)).view(B, T, H, D)
        return m.o_proj(m.o_norm(o.to(h.dtype), gate).reshape(B, T, -1)), rec

    def prefills_whole(self, kernels: bool) -> bool:
        # FLA's chunk kernels run on a GPU (their autotuner needs a driver); the layer's own
        # steps run on PyTorch either way (no specla kernel for KDA)
        return self.device.type == "cuda" and fla_installed()

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts from the state the layer holds (:meth:`specla.mixers.Mixer.prefill`): the short
        convolution along each prompt and its window at ``tp.counts``, then FLA's chunked KDA
        (``chunk_kda``, the per-channel gated delta rule; q already scaled, so scale 1) in
        float32. Padding rows get ``g = 0`` and ``beta = 0``, which leave the state as it is."""
        from fla.ops.kda import chunk_kda

        m, (B, T), H, D, st = self.m, h.shape[:2], self.H, self.D, self.state_dtype
        path, pad = tp.chain()
        mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], -1)
        q, k, v = tree_conv(mixed, self.conv, self.conv_w, self.conv_b, tp.conv_ancestors(self.C)).split(
            H * D, dim=-1)
        self.conv = conv_window_after(mixed, self.conv, path, tp.counts)
        q = self.l2norm(q.reshape(B, T, H, D).to(st), dim=-1, eps=1e-6) * D**-0.5
        k = self.l2norm(k.reshape(B, T, H, D).to(st), dim=-1, eps=1e-6)
        v = v.reshape(B, T, H, D).to(st)
        g = m.forget_gate(h).to(st).masked_fill(pad[..., None, None], 0.0)
        beta = torch.sigmoid(m.b_proj(h)).to(st).masked_fill(pad[..., None], 0.0)
        o, S = chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=self.S, output_final_state=True)
        self.S = S.to(st)
        gate = m.g_b_proj(m.g_a_proj(h)).view(B, T, H, D)
        return m.o_proj(m.o_norm(o.to(h.dtype), gate).reshape(B, T, -1))

    def commit(self, record: Record, path: Tensor, path_len: Tensor, kernels: bool) -> None:
        if isinstance(record, KDASnapshotRecord):
            self.S = take_accepted(record.states, self.S, path, path_len)
            self.conv = take_accepted(record.conv_windows, self.conv, path, path_len)
            return
        if isinstance(record, KDAFactorRecord):
            self.S = kda_commit_factor(self.S, record.k, record.delta, record.Gk, path, path_len)
        else:
            self.S = kda_commit_replay(self.S, record.k, record.v, record.g, record.beta, path, path_len)
        self.conv = conv_window_after(record.conv_x, self.conv, path, path_len)


class MLAMixer(AttentionMixer):
    """Kimi Linear's multi-head latent attention (``KimiLinearAttention``, no positional
    encoding) under draft trees, in the latent space (DeepSeek-V2's absorbed form): the KV cache
    holds per token only the normalised latent ``c`` (``kv_lora_rank``) and the key part shared
    by all heads ``k_rot``, as one key head ``[c ; k_rot]``, which also serves as the values
    (``shared_kv``: one cache; :meth:`output` reads only the latent part, ``sum_i p_i c_i``). Each head's
    query enters the latent space through its key up-projection, ``q' = [W_kb^T q_nope ;
    q_rot]``, and its attention output leaves through its value up-projection, ``o = W_vb
    o'[:kv_lora_rank]``; exact, since ``q_nope . (W_kb c) = (W_kb^T q_nope) . c`` and ``sum_i
    p_i W_vb c_i = W_vb sum_i p_i c_i``, with the layer's own scale ``qk_head_dim ** -0.5``.

    Args:
        attn: the layer's ``KimiLinearAttention`` module. dtype, device: the cache's.
    """

    shared_kv = True

    def __init__(self, attn: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        self.attn = attn
        self.R, self.Dn, self.Dr, self.Dv = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        w = attn.kv_b_proj.weight.detach().view(attn.num_heads, self.Dn + self.Dv, self.R)
        self.W_kb, self.W_vb = w[:, : self.Dn], w[:, self.Dn :]  # [H, Dn, R], [H, Dv, R]
        super().__init__(1, self.R + self.Dr, dtype, device, scale=attn.scaling)

    def project(self, h: Tensor, positions: Tensor):
        a, (B, T) = self.attn, h.shape[:2]
        q = a.q_proj(h) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(h)))
        q_nope, q_rot = q.view(B, T, -1, self.Dn + self.Dr).split([self.Dn, self.Dr], dim=-1)
        c, k_rot = a.kv_a_proj_with_mqa(h).split([self.R, self.Dr], dim=-1)
        c = a.kv_a_layernorm(c)
        q = torch.cat([torch.einsum("bthd,hdr->bthr", q_nope, self.W_kb), q_rot], -1)
        kv = torch.cat([c, k_rot], -1)[:, :, None]
        return q, kv, kv, None

    def output(self, o: Tensor, gate: Tensor | None) -> Tensor:
        o = torch.einsum("bthr,hdr->bthd", o[..., : self.R], self.W_vb)
        return self.attn.o_proj(o.reshape(*o.shape[:2], -1))


class KimiLinearAdapter(MixerAdapter):
    """Kimi Linear on the mixer core (see the module docstring).

    State per sequence: per KDA layer a float32 (float64 in float64 runs) state ``[B, H, K, V]``
    and a conv window; per MLA layer a latent KV cache ``[B, capacity + 65, 1, kv_lora_rank +
    qk_rope_head_dim]`` with its length. The model is used as it is when the run's device and dtype are its own and it is in
    eval mode, else as a converted copy.

    Args:
        model: a ``KimiLinearForCausalLM`` (checked by the plugin). config: the run's
            :class:`SpecConfig`.
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig):
        model = self._adopt(model, config, model.lm_head.weight)
        self.model, self.inner = model, model.model
        self.embed_weight = self.inner.embed_tokens.weight.detach()
        self.vocab_size = self.embed_weight.shape[0]
        self.eos_token_ids = eos_token_ids(model)
        self.layers = list(self.inner.layers)
        self.num_layers = len(self.layers)
        self.mixers = [MLAMixer(layer.self_attn, self.dtype, self.device) if hasattr(layer.self_attn, "kv_b_proj")
                       else KDAMixer(layer.self_attn, self.dtype, self.state_dtype, self.device)
                       for layer in self.layers]
        self._init_state()

    def _block(self, li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """``KimiLinearDecoderLayer``: ``x + mix(input_layernorm(x))``, then ``x +
        mlp(post_attention_layernorm(x))`` (dense MLP or MoE)."""
        layer = self.layers[li]
        x = x + mix(layer.input_layernorm(x))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., vocab]``: the final norm and the LM head."""
        return self.model.lm_head(self.inner.norm(hidden))
