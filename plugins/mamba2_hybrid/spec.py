"""Describes transformers' Mamba2 family as a :class:`specla.model.spec.ModelSpec`:
``Mamba2ForCausalLM``, ``BambaForCausalLM``, ``GraniteMoeHybridForCausalLM`` (Granite 4.0-H),
``NemotronHForCausalLM`` and ``FalconH1ForCausalLM``.

Only the sequence mixers are specla's: every Mamba2 layer runs the Mamba2 op's
:class:`specla.mixers.mamba2.mixer.Mamba2Mixer` (tree-aware conv, tree-masked SSD, factor records, its
Triton kernels on a GPU) from the layer's own weights, with the layer's own input projection,
gated RMSNorm and output projection; every attention layer runs the core's
:class:`specla.mixers.ProjectedAttention` (tree attention over a KV cache) with the layer's own
projections and rotary module. Everything position-wise (embeddings, norms, MLPs, MoE blocks, LM
head) is the checkpoint's transformers module, called on the verify rows. The families differ in
their block wiring (:func:`_block`) and scalar multipliers:

- Mamba2: ``norm -> mixer`` blocks, residual kept in float32 with ``residual_in_fp32``.
- Bamba: ``input_layernorm -> mamba | self_attn``, then ``pre_ff_layernorm -> feed_forward``.
- Granite 4.0-H: as Bamba, both residual branches scaled by ``residual_multiplier``, a shared MLP
  beside the MoE block, embeddings times ``embedding_multiplier``, logits divided by
  ``logits_scaling``, attention scaled by ``attention_multiplier`` (the module's own scaling).
- Nemotron-H: one sub-block per layer (Mamba2, attention without positions, MLP or MoE), each
  ``norm -> module`` with a residual.
- Falcon-H1: attention and Mamba2 side by side on the same normed input (two mixers in one
  layer), with the ``ssm_in`` / ``mup_vector`` / ``ssm_out`` / ``attention_in`` /
  ``attention_out`` / key / embedding / LM-head multipliers.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers import Mixer, ProjectedAttention, experts_graph_problem
from specla.mixers.mamba2.mixer import Mamba2Mixer
from specla.model.spec import ModelSpec, Placement

FAMILIES = ("mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1")


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM of :data:`FAMILIES` (``backbone`` for Mamba2)."""
    return model.backbone if model.config.model_type == "mamba2" else model.model


def layer_mixers(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """A decoder layer's sequence-mixer modules in the order the layer calls them: Mamba2
    (``A_log``) and attention (``q_proj``) modules; none for Nemotron-H's MLP and MoE layers,
    Mamba2 then attention for Falcon-H1's parallel layers."""
    subs = [getattr(layer, n, None) for n in ("mixer", "mamba", "self_attn")]
    return [m for m in subs if m is not None and (hasattr(m, "A_log") or hasattr(m, "q_proj"))]


def mamba2_hybrid_spec(model: torch.nn.Module, placement: Placement) -> ModelSpec:
    """transformers' Mamba2 family as a :class:`ModelSpec` (see the module docstring).

    State per sequence: for each Mamba2 layer a float32 (float64 in float64 runs) state ``[B, H,
    N, P]`` and a conv window ``[B, C - 1, Dc]``; for each attention layer a KV cache ``[B,
    capacity + 65, HKV, Dh]`` in the activation dtype with its length.

    Args:
        model: a causal LM of one of :data:`FAMILIES` (checked by the plugin), on the run's device
            and dtype.
        placement: the run's :class:`Placement`.
    """
    family, inner, cfg = model.config.model_type, _inner(model), model.config
    embed = inner.embeddings if family in ("mamba2", "nemotron_h") else inner.embed_tokens
    final_norm = getattr(inner, {"mamba2": "norm_f", "nemotron_h": "norm_f", "granitemoehybrid": "norm"}.get(
        family, "final_layernorm"))
    embed_scale = float(getattr(inner, "embedding_multiplier", getattr(cfg, "embedding_multiplier", 1.0))
                        if family in ("granitemoehybrid", "falcon_h1") else 1.0)
    logit_scale = {"granitemoehybrid": 1.0 / getattr(cfg, "logits_scaling", 1.0),
                   "falcon_h1": getattr(inner, "lm_head_multiplier", 1.0)}.get(family, 1.0)
    layers, lm_head = list(inner.layers), model.lm_head
    mixers = tuple(attention_mixer(m, model, placement) if hasattr(m, "q_proj") else _mamba2(m, placement)
                   for layer in layers for m in layer_mixers(layer))

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        return _block(layers[li], family, x, mix)

    def logits(hidden: Tensor) -> Tensor:
        """The model's final norm, LM head and logit multiplier."""
        out = lm_head(final_norm(hidden).to(lm_head.weight.dtype))
        return out * logit_scale if logit_scale != 1.0 else out

    return ModelSpec(model=model, embed_weight=embed.weight.detach(), logits=logits, mixers=mixers, block=block,
                     num_layers=len(layers), eos_token_ids=eos_token_ids(model), embed_scale=embed_scale,
                     graph_problem=experts_graph_problem(model, placement.dtype))


def _mamba2(m: torch.nn.Module, placement: Placement) -> Mixer:
    I, H = m.intermediate_size, m.num_heads  # noqa: E741
    in_mult = float(getattr(m, "ssm_in_multiplier", 1.0))
    mup = getattr(m, "mup_vector", None)  # Falcon-H1's per-channel multipliers of in_proj's output
    gated_norm = not isinstance(m.norm, torch.nn.Identity)
    dtype, st = placement.dtype, placement.state

    def project(h: Tensor):
        z = m.in_proj(h * in_mult if in_mult != 1.0 else h)
        if mup is not None:
            z = z * mup
        return z.split([I, m.conv_dim, H], dim=-1)

    def output(y: Tensor, z: Tensor) -> Tensor:
        # reshaped: some transformers versions' Falcon-H1 norm drops a length-1 sequence axis
        o = m.norm(y, z).reshape(y.shape) if gated_norm else y * torch.nn.functional.silu(z.to(y.dtype))
        return m.out_proj(o.to(dtype))

    lo, hi = m.time_step_limit
    conv = m.conv1d
    return Mamba2Mixer(project=project, conv_w=conv.weight.detach()[:, 0],
                       conv_b=conv.bias.detach() if conv.bias is not None else None, A_log=st(m.A_log),
                       dt_bias=st(m.dt_bias), D=st(m.D), dt_limit=(float(lo), float(hi)), H=H, P=m.head_dim,
                       N=m.ssm_state_size, G=m.n_groups, output=output, dtype=dtype,
                       state_dtype=placement.state_dtype, device=placement.device)


def attention_mixer(a: torch.nn.Module, model: torch.nn.Module, placement: Placement) -> ProjectedAttention:
    """The mixer of an attention module ``a`` of ``model`` (one of :data:`FAMILIES`, on the run's
    device and dtype): its projections and the model's rotary module (none for Nemotron-H, whose
    attention has no positional encoding). The MTP drafter builds its attention layer with it."""
    rotary = None if model.config.model_type == "nemotron_h" else getattr(_inner(model), "rotary_emb", None)
    apply = getattr(sys.modules[type(a).__module__], "apply_rotary_pos_emb", None)
    return ProjectedAttention(q_proj=a.q_proj, k_proj=a.k_proj, v_proj=a.v_proj, o_proj=a.o_proj,
                              num_kv_heads=a.k_proj.out_features // a.head_dim, head_dim=a.head_dim,
                              dtype=placement.dtype, device=placement.device, scale=a.scaling,
                              key_multiplier=float(getattr(a, "key_multiplier", 1.0)), rotary=rotary,
                              apply_rotary=apply)


def _block(layer: torch.nn.Module, family: str, x: Tensor, mix) -> Tensor:
    """One decoder layer of ``family`` on the residual stream ``x [B, T, hidden]`` (the module
    docstring's wirings)."""
    if family == "mamba2":  # residual_in_fp32 keeps the residual stream in float32 between blocks
        residual = x.float() if layer.residual_in_fp32 else x
        return residual + mix(layer.norm(x.to(layer.norm.weight.dtype)))
    if family == "nemotron_h":
        h = layer.norm(x.to(layer.norm.weight.dtype))
        return x + (mix(h) if layer_mixers(layer) else layer.mixer(h))
    h = layer.input_layernorm(x)
    if family == "falcon_h1":
        m = mix(h) * layer.ssm_out_multiplier  # the Mamba2 mixer first: the mixers' order
        x = x + (m + mix(h * layer.attention_in_multiplier) * layer.attn_out_multiplier)
        return x + layer.feed_forward(layer.pre_ff_layernorm(x))
    if family == "bamba":
        x = x + mix(h)
        return x + layer.feed_forward(layer.pre_ff_layernorm(x))
    rm = layer.residual_multiplier  # granitemoehybrid
    x = x + mix(h) * rm
    h = layer.post_attention_layernorm(x)
    y = layer.shared_mlp(h)
    if layer.has_experts:
        y = layer.block_sparse_moe(h) + y
    return x + y * rm
