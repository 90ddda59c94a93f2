"""Describes transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (or the text model
inside a multimodal Qwen3.5 checkpoint) and ``Qwen3NextForCausalLM`` as a
:class:`specla.model.spec.ModelSpec`.

Qwen3.5 and Qwen3-Next interleave Gated DeltaNet layers (``linear_attention``) with gated softmax
attention (``full_attention``, every fourth layer by default); they differ in the GDN layer's
projection layout (Qwen3-Next groups q, k, v, z and b, a per key head) and in the rotary
module's position form. Only the sequence mixers are specla's: each
GDN layer runs :class:`specla.mixers.gdn.mixer.GDNMixer` (the GDN op's tree verify, records and
kernels) from the layer's own weights, each attention layer :class:`QwenAttention` (the core's
tree attention over a KV cache). Everything position-wise (embeddings, the zero-centred RMSNorms,
the MLP or the MoE block, the gated output norm, q/k norms, the rotary embedding, the LM head) is
the checkpoint's own transformers module, called on the verify rows, except that where the
plugin's Triton kernels run without autograd each RMSNorm is one launch of
:func:`specla.ops.norm_triton.rms_norm` on the module's own weight and epsilon (same formula,
computed in float32; transformers' form takes six to eight launches, and a recorded step is bound
by its launches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers import AttentionMixer, Mixer, experts_graph_problem
from specla.mixers.gdn.mixer import GDNMixer
from specla.model.spec import ModelSpec, Placement
from specla.ops import kernels

norm_kernels = kernels("specla.ops.norm_triton")


def text_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(text model, LM head)`` of a Qwen3.5 causal LM or of a multimodal Qwen3.5 model (its
    ``model.language_model``)."""
    inner = model.model
    return getattr(inner, "language_model", inner), model.lm_head


def eager_experts_for_float64(model: torch.nn.Module) -> None:
    """Switch a float64 model's MoE experts to transformers' eager implementation (its default
    grouped GEMM takes no float64); only for a model specla owns (loaded or copied by it)."""
    if model.get_input_embeddings().weight.dtype == torch.float64:
        for c in (model.config, text_parts(model)[0].config):
            if getattr(c, "_experts_implementation", None) not in (None, "eager"):
                c._experts_implementation = "eager"


def norm(module: torch.nn.Module, x: Tensor, kernels: bool) -> Tensor:
    """A zero-centred RMSNorm module (``Qwen3_5RMSNorm``, ``Qwen3NextRMSNorm``: ``x * rsqrt(mean(x^2)
    + eps) * (1 + weight)`` in float32, returned in ``x``'s dtype) on ``x [..., hidden]``: its own
    forward, or with ``kernels`` (the run's ``Placement.triton_kernels``: every norm of a model takes the
    same form, whatever a pass's records) and no autograd one Triton launch of the same formula."""
    if kernels and not torch.is_grad_enabled():
        return norm_kernels.rms_norm(x, module.weight, module.eps, unit_offset=True)
    return module(x)


def decoder_layer(layer: torch.nn.Module, x: Tensor, mix, kernels: bool = False) -> Tensor:
    """A Qwen decoder layer on the residual stream ``x [B, T, hidden]``: ``x + mix(norm(x))``
    with the layer's sequence mixer behind ``mix``, then its MLP or MoE (some MoE blocks also
    return router logits, dropped), each with the layer's own pre-norm (see :func:`norm` for
    ``kernels``)."""
    x = x + mix(norm(layer.input_layernorm, x, kernels))
    y = layer.mlp(norm(layer.post_attention_layernorm, x, kernels))
    return x + (y[0] if isinstance(y, tuple) else y)


def rotary_cos_sin(rotary: torch.nn.Module, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``[B, T, rotary dims]`` in ``h``'s dtype, from the text model's rotary
    module ``rotary`` at int64 ``positions [B, T]`` (``h [B, T, hidden]`` gives dtype and device).
    Qwen3.5's module takes one position per multimodal grid axis, ``[3, B, T]`` (all equal for
    text; transformers before 5.24 requires this form); Qwen3-Next's takes ``[B, T]``."""
    if hasattr(rotary, "mrope_section"):
        positions = positions[None].expand(3, -1, -1)
    return rotary(h, positions)


class QwenAttention(AttentionMixer):
    """A Qwen3.5 / Qwen3-Next ``full_attention`` layer under draft trees: ``q_proj`` gives each
    head's query and output gate, per-head zero-centred RMSNorms on q and k, partial rotary
    embedding at the nodes' positions (the model's own rotary module), grouped-query heads, and
    ``o_proj(attention * sigmoid(gate))`` (transformers' ``Qwen3_5Attention``).

    Args:
        attn: the layer's ``self_attn`` module. rotary: the text model's ``rotary_emb``.
        dtype, device: the KV cache's.
        kernels: the q/k norms as Triton launches where no gradient is taken (see :func:`norm`).
    """

    def __init__(self, attn: torch.nn.Module, rotary: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 kernels: bool = False):
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        self.attn, self.rotary, self._rope, self.kernels = attn, rotary, apply_rotary_pos_emb, kernels
        super().__init__(attn.config.num_key_value_heads, attn.head_dim, dtype, device, scale=attn.scaling)

    def project(self, h: Tensor, positions: Tensor):
        a, (B, T), D = self.attn, h.shape[:2], self.Dh
        q, gate = torch.chunk(a.q_proj(h).view(B, T, -1, 2 * D), 2, dim=-1)
        q = norm(a.q_norm, q, self.kernels)
        k = norm(a.k_norm, a.k_proj(h).view(B, T, -1, D), self.kernels)
        v = a.v_proj(h).view(B, T, -1, D)
        cos, sin = rotary_cos_sin(self.rotary, h, positions)
        q, k = self._rope(q, k, cos, sin, unsqueeze_dim=2)
        return q, k, v, gate.reshape(B, T, -1)

    def output(self, o: Tensor, gate: Tensor | None) -> Tensor:
        B, T = o.shape[:2]
        return self.attn.o_proj(o.reshape(B, T, -1) * torch.sigmoid(gate))


def qwen_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """Qwen3.5 (dense and MoE) and Qwen3-Next as a :class:`ModelSpec` (see the module docstring).

    State per sequence: for each GDN layer a float32 (float64 in float64 runs) recurrent state
    ``[B, HV, K, V]`` and a conv window ``[B, C - 1, Dc]``; for each attention layer a KV cache
    ``[B, capacity + 65, HKV, Dh]`` in the activation dtype with its length. In float64 the
    adapter's own copy of a model runs its MoE experts in transformers' eager implementation.

    Args:
        model: a ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, a multimodal Qwen3.5 model
            (its text part runs) or a ``Qwen3NextForCausalLM``, on the run's device and dtype.
        placement: the run's :class:`Placement`.
    """
    if placement.own_copy:
        eager_experts_for_float64(model)
    text, head = text_parts(model)
    layers, kernels = list(text.layers), placement.triton_kernels  # every norm takes one form: see norm

    def block(li: int, x: Tensor, mix, _kernels: bool) -> Tensor:
        return decoder_layer(layers[li], x, mix, kernels)

    def logits(hidden: Tensor) -> Tensor:
        """The model's final norm (see :func:`norm`) and LM head."""
        return head(norm(text.norm, hidden, kernels))

    return ModelSpec(model=model, embed_weight=text.embed_tokens.weight.detach(), logits=logits,
                     mixers=tuple(_mixer(layer, text, placement) for layer in layers), block=block,
                     num_layers=len(layers), eos_token_ids=eos_token_ids(model),
                     graph_problem=experts_graph_problem(model, placement.dtype))


def _mixer(layer: torch.nn.Module, text: torch.nn.Module, placement: Placement) -> Mixer:
    dtype, triton_norms = placement.dtype, placement.triton_kernels
    if hasattr(layer, "self_attn"):  # a full_attention layer
        return QwenAttention(layer.self_attn, text.rotary_emb, dtype, placement.device, triton_norms)
    lin = layer.linear_attn
    Vd = lin.head_v_dim

    def project(h: Tensor, kernels: bool):
        if hasattr(lin, "in_proj_qkvz"):  # Qwen3-Next: regrouped by the layer's own method
            q, k, v, z, b, a = lin.fix_query_key_value_ordering(lin.in_proj_qkvz(h), lin.in_proj_ba(h))
            flat = lambda x: x.reshape(*h.shape[:2], -1)  # noqa: E731
            return torch.cat([flat(q), flat(k), flat(v)], -1), a, b, flat(z)
        return lin.in_proj_qkv(h), lin.in_proj_a(h), lin.in_proj_b(h), lin.in_proj_z(h)

    gated = lin.norm

    def output(o: Tensor, z: Tensor, kernels: bool) -> Tensor:
        B, T = o.shape[:2]  # transformers' gated norm takes o in the activation dtype
        o, z = o.to(dtype).reshape(-1, Vd), z.reshape(-1, Vd)
        # the same formula in one launch, chosen as every norm of the model is (see :func:`norm`)
        if triton_norms and not torch.is_grad_enabled() and gated.activation in ("silu", "swish", "sigmoid"):
            y = norm_kernels.rms_norm(o, gated.weight, gated.variance_epsilon, z, gated.activation, out_dtype=dtype)
        else:
            y = gated(o, z)
        return lin.out_proj(y.reshape(B, T, -1))

    conv = lin.conv1d
    conv_b = conv.bias.detach() if conv.bias is not None else None
    return GDNMixer(project=project, conv_w=conv.weight.detach()[:, 0], conv_b=conv_b, A_log=placement.state(lin.A_log),
                    dt_bias=placement.state(lin.dt_bias), H=lin.num_k_heads, HV=lin.num_v_heads, K=lin.head_k_dim,
                    V=Vd, beta_scale=1.0, output=output, dtype=dtype, state_dtype=placement.state_dtype,
                    device=placement.device)
