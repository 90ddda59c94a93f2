"""Turns transformers' Mamba2 family into a :class:`specla.TargetAdapter` on the mixer core:
``Mamba2ForCausalLM``, ``BambaForCausalLM``, ``GraniteMoeHybridForCausalLM`` (Granite 4.0-H),
``NemotronHForCausalLM`` and ``FalconH1ForCausalLM``.

Only the sequence mixers are specla's: every Mamba2 layer runs the Mamba2 op's
:class:`specla.mixers.mamba2.mixer.Mamba2Mixer` (tree-aware conv, tree-masked SSD, factor records, its
Triton kernels on a GPU) from the layer's own weights, with the layer's own input projection,
gated RMSNorm and output projection; every attention layer runs the core's
:class:`specla.mixers.ProjectedAttention` (tree attention over a KV cache) with the layer's own
projections and rotary module. Everything position-wise (embeddings, norms, MLPs, MoE blocks, LM
head) is the checkpoint's transformers module, called on the verify rows. The families differ in
their block wiring (:meth:`Mamba2HybridAdapter._block`) and scalar multipliers:

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

from specla.config import SpecConfig
from specla.layerwise import eos_token_ids
from specla.mixers import MixerAdapter, ProjectedAttention, experts_graph_problem
from specla.mixers.mamba2.mixer import Mamba2Mixer

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


class Mamba2HybridAdapter(MixerAdapter):
    """transformers' Mamba2 family on the mixer core (see the module docstring).

    State per sequence: for each Mamba2 layer a float32 (float64 in float64 runs) state ``[B, H,
    N, P]`` and a conv window ``[B, C - 1, Dc]``; for each attention layer a KV cache ``[B,
    capacity + 65, HKV, Dh]`` in the activation dtype with its length. The model's modules are
    used as they are when the run's device and dtype are the model's and it is in eval mode;
    otherwise a converted copy in eval mode is made once (the caller's model is never modified).

    Args:
        model: a causal LM of one of :data:`FAMILIES` (checked by the plugin).
        config: the run's :class:`SpecConfig`.
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig):
        model = self._adopt(model, config, model.lm_head.weight)
        self.model, self.family = model, model.config.model_type
        inner, cfg = _inner(model), model.config
        self.inner = inner
        embed = inner.embeddings if self.family in ("mamba2", "nemotron_h") else inner.embed_tokens
        self.embed_weight = embed.weight.detach()
        self.vocab_size = self.embed_weight.shape[0]
        self.eos_token_ids = eos_token_ids(model)
        self.final_norm = {"mamba2": "norm_f", "nemotron_h": "norm_f", "granitemoehybrid": "norm"}.get(
            self.family, "final_layernorm")
        self.embed_scale = float(getattr(inner, "embedding_multiplier", getattr(cfg, "embedding_multiplier", 1.0))
                                 if self.family in ("granitemoehybrid", "falcon_h1") else 1.0)
        self.logit_scale = {"granitemoehybrid": 1.0 / getattr(cfg, "logits_scaling", 1.0),
                            "falcon_h1": getattr(inner, "lm_head_multiplier", 1.0)}.get(self.family, 1.0)
        self.layers = list(inner.layers)
        self.num_layers = len(self.layers)
        self.mixers = [self._mixer(m) for layer in self.layers for m in layer_mixers(layer)]
        self._experts_problem = experts_graph_problem(model, self.dtype)
        self._init_state()

    # ------------------------------------------------------------------ mixers
    def _mixer(self, m: torch.nn.Module):
        if hasattr(m, "q_proj"):
            return self._attention(m)
        st = lambda p: p.detach().to(self.state_dtype)  # noqa: E731
        I, H = m.intermediate_size, m.num_heads  # noqa: E741
        in_mult = float(getattr(m, "ssm_in_multiplier", 1.0))
        mup = getattr(m, "mup_vector", None)  # Falcon-H1's per-channel multipliers of in_proj's output
        gated_norm = not isinstance(m.norm, torch.nn.Identity)
        dtype = self.dtype  # a value, not self, in the mixer's closures (see LayerwiseAdapter)

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
                           N=m.ssm_state_size, G=m.n_groups, output=output, dtype=self.dtype,
                           state_dtype=self.state_dtype, device=self.device)

    def _attention(self, a: torch.nn.Module) -> ProjectedAttention:
        rotary = getattr(self.inner, "rotary_emb", None)
        if self.family == "nemotron_h":  # Nemotron-H's attention has no positional encoding
            rotary = None
        apply = getattr(sys.modules[type(a).__module__], "apply_rotary_pos_emb", None)
        return ProjectedAttention(q_proj=a.q_proj, k_proj=a.k_proj, v_proj=a.v_proj, o_proj=a.o_proj,
                                  num_kv_heads=a.k_proj.out_features // a.head_dim, head_dim=a.head_dim,
                                  dtype=self.dtype, device=self.device, scale=a.scaling,
                                  key_multiplier=float(getattr(a, "key_multiplier", 1.0)), rotary=rotary,
                                  apply_rotary=apply)

    # ------------------------------------------------------------------ model
    def graph_problem(self) -> str | None:
        """See :func:`specla.mixers.experts_graph_problem` (MoE experts that read the host)."""
        return self._experts_problem

    def _block(self, li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        layer, fam = self.layers[li], self.family
        if fam == "mamba2":  # residual_in_fp32 keeps the residual stream in float32 between blocks
            residual = x.float() if layer.residual_in_fp32 else x
            return residual + mix(layer.norm(x.to(layer.norm.weight.dtype)))
        if fam == "nemotron_h":
            h = layer.norm(x.to(layer.norm.weight.dtype))
            return x + (mix(h) if layer_mixers(layer) else layer.mixer(h))
        h = layer.input_layernorm(x)
        if fam == "falcon_h1":
            m = mix(h) * layer.ssm_out_multiplier  # the Mamba2 mixer first: self.mixers' order
            x = x + (m + mix(h * layer.attention_in_multiplier) * layer.attn_out_multiplier)
            return x + layer.feed_forward(layer.pre_ff_layernorm(x))
        if fam == "bamba":
            x = x + mix(h)
            return x + layer.feed_forward(layer.pre_ff_layernorm(x))
        rm = layer.residual_multiplier  # granitemoehybrid
        x = x + mix(h) * rm
        h = layer.post_attention_layernorm(x)
        y = layer.shared_mlp(h)
        if layer.has_experts:
            y = layer.block_sparse_moe(h) + y
        return x + y * rm

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., vocab]``: the model's final norm, LM head and logit multiplier."""
        h = getattr(self.inner, self.final_norm)(hidden)
        logits = self.model.lm_head(h.to(self.model.lm_head.weight.dtype))
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits
