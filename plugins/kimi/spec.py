"""Describes transformers' ``KimiLinearForCausalLM`` as a :class:`specla.model.spec.ModelSpec`.

Kimi Linear interleaves Kimi Delta Attention (KDA: a gated delta rule whose decay is per key
channel, with a short convolution over q, k, v) with multi-head latent attention (MLA) without
positional encoding. :class:`~specla.mixers.kda.mixer.KDAMixer` verifies a draft tree in one
factorized pass (:func:`specla.mixers.kda.reference.tree_kda`: every node's output and delta as if
the recurrence ran along its root path) and commits the accepted path from compact per-token factor records ``(k,
delta, Gk)`` in closed form (``factor``), from per-node states (``snapshot``) or by running its
tokens again (``replay``); :class:`MLAMixer` runs the core's tree attention in MLA's latent
space over a KV cache of the latents (one head of ``kv_lora_rank + qk_rope_head_dim``). The
checkpoint's own modules do everything else (projections, gates, norms, MLP / MoE, LM head).
Where the engine runs Triton kernels, the KDA layers verify and commit with
:mod:`specla.mixers.kda.verify` and :mod:`specla.mixers.kda.commit`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers import AttentionMixer, experts_graph_problem
from specla.mixers.kda.mixer import KDAMixer
from specla.model.spec import ModelSpec, Placement


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


def kimi_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """Kimi Linear as a :class:`ModelSpec` (see the module docstring).

    State per sequence: per KDA layer a float32 (float64 in float64 runs) state ``[B, H, K, V]``
    and a conv window; per MLA layer a latent KV cache ``[B, capacity + 65, 1, kv_lora_rank +
    qk_rope_head_dim]`` with its length.

    Args:
        model: a ``KimiLinearForCausalLM`` (checked by the plugin), on the run's device and dtype.
        placement: the run's :class:`Placement`.
    """
    inner, dtype, device = model.model, placement.dtype, placement.device
    layers, lm_head = list(inner.layers), model.lm_head

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        """``KimiLinearDecoderLayer``: ``x + mix(input_layernorm(x))``, then ``x +
        mlp(post_attention_layernorm(x))`` (dense MLP or MoE)."""
        layer = layers[li]
        x = x + mix(layer.input_layernorm(x))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(hidden: Tensor) -> Tensor:
        """The final norm and the LM head."""
        return lm_head(inner.norm(hidden))

    mixers = tuple(MLAMixer(layer.self_attn, dtype, device) if hasattr(layer.self_attn, "kv_b_proj")
                   else KDAMixer(layer.self_attn, dtype, placement.state_dtype, device) for layer in layers)
    return ModelSpec(model=model, embed_weight=inner.embed_tokens.weight.detach(), logits=logits, mixers=mixers,
                     block=block, num_layers=len(layers), eos_token_ids=eos_token_ids(model),
                     graph_problem=experts_graph_problem(model, placement.dtype))
