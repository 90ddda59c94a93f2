"""Turns a transformers/FLA ``GatedDeltaNetForCausalLM`` into a :class:`specla.TargetAdapter`.

The reference path: the whole model runs layer-major over the draft tree in PyTorch from the
model's own weights (FLA's modules are Triton-only, so they cannot serve CPU users). Per layer:
q/k/v/a/b/g projections, tree-aware short convolution + SiLU, L2-normalised q/k, gates
``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, tree-masked GDN with factor
records, gated RMSNorm, output projection, then the MLP; final norm and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.config import SpecConfig
from specla.layerwise import PREFILL_CHUNK, LayerwiseAdapter, eos_token_ids
from specla.records import PendingCommit, Record
from specla.tree import inclusive_ancestor_mask

from .records import GDNReplayRecord
from specla.ops import act_triton as act_kernels
from specla.ops import conv_triton as conv_kernels
from specla.ops import norm_triton as norm_kernels
from specla.ops.act import decay_and_sigmoid_gates
from specla.ops.conv import causal_conv, conv_ancestors, tree_conv
from specla.ops.norm import gated_rms_norm, l2norm, rms_norm

from .reference import chunk_gdn, tree_gdn
from .mixer import apply_pending, commit_layer, kernel_plan, layer_record, replay_commit, run_verify_kernel



@dataclass
class _Layer:
    """One GDN block's weights, converted once to the run's device and dtype."""

    attn_norm: Tensor
    attn_eps: float
    w_qkv: Tensor  # [2 * H * K + HV * V, hidden]
    w_a: Tensor  # [HV, hidden]
    w_b: Tensor  # [HV, hidden]
    w_g: Tensor | None  # [HV * V, hidden], None without output gate
    conv_w: Tensor | None  # [Dc, C]
    conv_b: Tensor | None  # [Dc]
    A_log: Tensor  # [HV] float32
    dt_bias: Tensor  # [HV] float32
    o_norm: Tensor  # [V]
    o_eps: float
    gate_act: str  # swish | silu | sigmoid
    w_o: Tensor  # [hidden, HV * V]
    mlp_norm: Tensor
    mlp_eps: float
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    neg_A: Tensor  # [HV] float32, -exp(A_log): the gate's constant factor, computed once
    w_in: Tensor | None  # [w_qkv; w_a; w_b; w_g] stacked (the fused path's one input GEMM), else None
    w_gu: Tensor | None  # [w_gate; w_up] stacked (one MLP input GEMM), else None
    H: int
    HV: int
    K: int
    V: int
    beta_scale: float  # 2 with allow_neg_eigval, else 1


class GDNAdapter(LayerwiseAdapter):
    """Reference-path adapter for Gated DeltaNet (see module docstring).

    State per sequence: ``recurrent[l]`` ``[B, HV, K, V]`` float32 (float64 for float64 runs),
    ``conv[l]`` ``[B, C - 1, Dc]`` activation dtype (``None`` without short conv), ``roots``
    ``[B]`` int64. Weights are read from ``model`` once; ``model`` itself is not modified.

    Args:
        model: a ``fla.models.GatedDeltaNetForCausalLM``.
        config: the run's :class:`SpecConfig` (``dtype``/``device`` override the model's).
        differentiable: build the weights without detaching them, so :meth:`score` can be
            trained through (the target training recipe uses it; FLA's own training kernels
            refuse Hopper GPUs with Triton < 3.7.1).
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig, *, differentiable: bool = False):
        self.differentiable = differentiable
        ref = model.lm_head.weight
        self._place(config, ref)
        # differentiable: keep the autograd link to the model's parameters (training recipes)
        keep = (lambda p: p) if differentiable else (lambda p: p.detach())  # noqa: E731
        act = lambda p: keep(p).to(self.device, self.dtype)  # noqa: E731
        st = lambda p: keep(p).to(self.device, self.state_dtype)  # noqa: E731
        m = model.model
        self.embed_weight = act(m.embeddings.weight)
        self.vocab_size = self.embed_weight.shape[0]
        self.eos_token_ids = eos_token_ids(model)
        self.norm, self.norm_eps = act(m.norm.weight), m.norm.eps
        self.lm_head = act(model.lm_head.weight)
        # the fused path (Triton kernels) stacks the input projections into one GEMM each; the
        # separate weights are then row views of the stacks (no extra memory)
        stack = self.triton_kernels and not differentiable
        self.layers = []
        for blk in m.layers:
            a = blk.attn
            conv = [a.q_conv1d, a.k_conv1d, a.v_conv1d] if a.use_short_conv else None
            ins = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.a_proj.weight, a.b_proj.weight]
            ins += [a.g_proj.weight] if a.use_gate else []
            HV, Dc = a.num_v_heads, sum(w.shape[0] for w in ins[:3])
            mlp = [blk.mlp.gate_proj.weight, blk.mlp.up_proj.weight]
            I = mlp[0].shape[0]
            if stack:
                w_in, w_gu = act(torch.cat(ins)), act(torch.cat(mlp))
                w_qkv, w_a, w_b, w_g = w_in[:Dc], w_in[Dc:Dc + HV], w_in[Dc + HV:Dc + 2 * HV], w_in[Dc + 2 * HV:]
                w_gate, w_up = w_gu[:I], w_gu[I:]
            else:
                w_in = w_gu = None
                w_qkv, w_a, w_b, w_g = act(torch.cat(ins[:3])), act(ins[3]), act(ins[4]), act(ins[-1])
                w_gate, w_up = act(mlp[0]), act(mlp[1])
            self.layers.append(
                _Layer(
                    attn_norm=act(blk.attn_norm.weight), attn_eps=blk.attn_norm.eps,
                    w_qkv=w_qkv, w_a=w_a, w_b=w_b, w_g=w_g if a.use_gate else None,
                    conv_w=act(torch.cat([c.weight[:, 0] for c in conv])) if conv else None,
                    conv_b=act(torch.cat([c.bias for c in conv])) if conv and conv[0].bias is not None else None,
                    A_log=st(a.A_log), dt_bias=st(a.dt_bias),
                    o_norm=act(a.o_norm.weight), o_eps=a.o_norm.eps,
                    gate_act=getattr(a.o_norm, "activation", "swish"),
                    w_o=act(a.o_proj.weight),
                    mlp_norm=act(blk.mlp_norm.weight), mlp_eps=blk.mlp_norm.eps,
                    w_gate=w_gate, w_up=w_up, w_down=act(blk.mlp.down_proj.weight),
                    neg_A=-torch.exp(st(a.A_log)), w_in=w_in, w_gu=w_gu,
                    H=a.num_heads, HV=HV, K=a.head_k_dim, V=a.head_v_dim,
                    beta_scale=2.0 if a.allow_neg_eigval else 1.0,
                )
            )
        self.conv_width = self.layers[0].conv_w.shape[1] if self.layers[0].conv_w is not None else 0
        self._init_state()

    # ------------------------------------------------------------------ state
    def _empty_state(self, B: int) -> None:
        self.recurrent = [
            torch.zeros(B, L.HV, L.K, L.V, dtype=self.state_dtype, device=self.device) for L in self.layers
        ]
        self.conv = [
            torch.zeros(B, self.conv_width - 1, L.w_qkv.shape[0], dtype=self.dtype, device=self.device)
            if L.conv_w is not None else None
            for L in self.layers
        ]

    # ------------------------------------------------------------------ model
    def forward(self, tokens: Tensor, parents: Tensor, counts: Tensor, records: str, logits: bool = True,
                pending: PendingCommit | None = None):
        """Run the model over a batch of trees hanging from the committed state.

        Args:
            tokens: ``[B, T]`` int64 node tokens (already validated).
            parents: ``[B, T]`` int64, ``-1`` = child of the committed state.
            counts: ``[B]`` int64 real nodes per row (the rest is padding; kernels may skip it).
            records: which record type to build (``factor``, ``snapshot``, ``replay``).
            logits: whether to compute the LM head (prefill skips it).
            pending: a factor commit to apply first, layer by layer (the delayed commit; with
                ``kernels="triton"`` it is fused into the verify kernel).
        Returns:
            ``(logits [B, T, vocab] or None, hidden [B, T, hidden], records tuple)``.
        """
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            return self._forward(tokens, parents, counts, records, logits, pending)

    def _mixer_inputs(self, L: _Layer, h: Tensor, conv, fused: bool = False):
        """Projections, short conv (``conv(proj)``; SiLU alone when ``None``), L2-normalised q/k,
        gates. Returns ``proj [B, T, Dc]``, ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``,
        ``g, beta [B, T, HV]`` (state dtype) and the output gate's pre-activation
        ``[B, T, HV * V]`` (``None``: computed later from ``h``, or no gate).

        ``fused``: one GEMM for every input projection (``w_in``), one Triton launch for both
        L2 norms and one for both gates, instead of four GEMMs and sixteen elementwise kernels
        (same formulas)."""
        B, T = h.shape[:2]
        Dc, HV = L.w_qkv.shape[0], L.HV
        gate = None
        if fused:
            z = h @ L.w_in.T
            proj, a_raw, b_raw = z[..., :Dc], z[..., Dc:Dc + HV], z[..., Dc + HV:Dc + 2 * HV]
            gate = z[..., Dc + 2 * HV:] if L.w_g is not None else None
        else:
            proj, a_raw, b_raw = h @ L.w_qkv.T, h @ L.w_a.T, h @ L.w_b.T
        qkv = conv(proj) if conv is not None else F.silu(proj)
        if fused:
            q, k = norm_kernels.l2norm_pair(qkv, L.H, L.K)
        else:
            q, k = l2norm(qkv[..., : L.H * L.K].reshape(B, T, L.H, L.K)), \
                l2norm(qkv[..., L.H * L.K : 2 * L.H * L.K].reshape(B, T, L.H, L.K))
        v = qkv[..., 2 * L.H * L.K :].reshape(B, T, HV, L.V)
        if fused:  # the state is float32 on this path
            g, beta = act_kernels.decay_and_sigmoid_gates(a_raw, b_raw, L.dt_bias, L.neg_A, L.beta_scale)
        else:
            g, beta = decay_and_sigmoid_gates(a_raw, b_raw, L.dt_bias, L.neg_A, L.beta_scale, self.state_dtype)
        return proj, q, k, v, g, beta, gate

    def _mixer_output_and_mlp(self, L: _Layer, x: Tensor, h: Tensor, o: Tensor, gate: Tensor | None = None,
                              fused: bool = False) -> Tensor:
        """Gated RMSNorm of the GDN output ``o [B, T, HV, V]``, output projection and residual,
        then the MLP block; returns the new residual stream ``[B, T, hidden]``. ``fused``: the
        gated norm, the MLP's norm and its SwiGLU are single Triton launches, the gate's
        pre-activation ``gate`` comes from the fused input GEMM, the MLP has one input GEMM
        (``w_gu``), and both residual adds run inside their GEMMs (in-place ``addmm_``)."""
        B, T = x.shape[:2]
        if fused:
            og = gate.reshape(B, T, L.HV, L.V) if gate is not None else None
            o = norm_kernels.rms_norm(o, L.o_norm, L.o_eps, og, L.gate_act, out_dtype=self.dtype)
            # residual adds inside the GEMMs: in-place addmm_ is one GEMM with beta = 1 (out of
            # place it would copy x first); x is this pass's own residual stream, held nowhere else
            x = x.reshape(B * T, -1).contiguous()
            x.addmm_(o.reshape(B * T, -1), L.w_o.T)
            gu = norm_kernels.rms_norm(x, L.mlp_norm, L.mlp_eps) @ L.w_gu.T
            x.addmm_(act_kernels.swiglu(gu, L.w_gate.shape[0]), L.w_down.T)
            return x.view(B, T, -1)
        st = self.state_dtype
        if L.w_g is not None:
            o = gated_rms_norm(o, L.o_norm, L.o_eps, (h @ L.w_g.T).view(B, T, L.HV, L.V), L.gate_act)
        else:
            o = rms_norm(o, L.o_norm, L.o_eps).to(st)
        x = x + o.reshape(B, T, -1).to(self.dtype) @ L.w_o.T
        h = rms_norm(x, L.mlp_norm, L.mlp_eps)
        return x + (F.silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T

    def _forward(self, tokens: Tensor, parents: Tensor, counts: Tensor, records: str, logits: bool,
                 pending: PendingCommit | None):
        mask = inclusive_ancestor_mask(parents)
        anc = conv_ancestors(parents, self.conv_width) if self.conv_width else None
        x = self.embed_weight[tokens]
        B, T = tokens.shape
        out_records: list[Record] = []
        kernel = self._use_kernel(records)
        plan = kernel_plan(lambda pick: self._kernel_choice(pick, parents, counts), parents, counts) if kernel else None
        norm = norm_kernels.rms_norm if kernel else rms_norm
        for li, L in enumerate(self.layers):
            prev = pending.records[li] if pending is not None else None
            if prev is not None:
                self.recurrent[li], self.conv[li] = apply_pending(self.recurrent[li], self.conv[li], prev, pending.path,
                                                                  pending.path_len, kernel)
            h = norm(x, L.attn_norm, L.attn_eps)
            conv = conv_kernels.tree_conv if kernel else tree_conv
            proj, q, k, v, g, beta, gate = self._mixer_inputs(
                L, h, (lambda p: conv(p, self.conv[li], L.conv_w, L.conv_b, anc)) if anc is not None else None,
                fused=kernel)
            S0 = self.recurrent[li]
            if kernel:  # fused: the kernel applies the pending commit to S0 in place, then verifies
                fused = None if prev is None else (prev.k, prev.delta, prev.G, pending.path, pending.path_len)
                o, delta, G = run_verify_kernel(plan, q, k, v, g, beta, S0, parents, counts, mask, L.K**-0.5, fused)
            else:
                o, delta, G = self._reference_verify(q, k, v, g, beta, S0, mask, L.K**-0.5, records)
            out_records.append(layer_record(records, S0, k, v, g, beta, delta, G, mask, proj, self.conv[li], anc,
                                            self.state_dtype))
            x = self._mixer_output_and_mlp(L, x, h, o, gate, fused=kernel)
        out = self.lm_logits(x) if logits else None
        return out, x, tuple(out_records)

    def _reference_verify(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, mask: Tensor,
                          scale: float, records: str) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The reference path's recurrence over the tree (:func:`reference.tree_gdn`; shapes
        there) for a pass building ``records``. One method so that a baseline can swap the
        recurrence alone (the FLA-SD row of ``benchmarks/e2e.py`` runs FLA's kernel over the
        chains of ``replay`` passes); ``delta`` and ``G`` may then be ``None``, which only
        replay records allow."""
        return tree_gdn(q, k, v, g, beta, S0, mask, scale)

    def _replay_commit(self, S0: Tensor, rec: GDNReplayRecord, path: Tensor, path_len: Tensor) -> Tensor:
        """Token-replay commit of one layer (:func:`reference.gdn_commit_replay`): ``[B, HV, K,
        V]`` after the accepted path. One method so that a baseline can swap it (see above)."""
        return replay_commit(S0, rec, path, path_len)

    def _apply(self, records: tuple[Record, ...], path: Tensor, path_len: Tensor) -> None:
        """Commit ``path`` (``[B, P]``, ``path_len [B]``) to every layer from its records."""
        kernel = self._use_kernel("factor")
        for li, rec in enumerate(records):
            self.recurrent[li], self.conv[li] = commit_layer(self.recurrent[li], self.conv[li], rec, path, path_len,
                                                             kernel, self._replay_commit)

    # ------------------------------------------------------------------ contract
    def score(self, tokens: Tensor, return_hidden: bool = False):
        """Teacher-forced logits of whole sequences from an empty state.

        Runs every layer over the whole sequence at once: causal short conv and the chunked
        (WY-form) gated delta rule (:func:`reference.chunk_gdn`), a few launches per chunk instead
        of the verify path's tree machinery; equal to decoding token by token (tested).

        Args:
            tokens: ``[B, T]`` int64, ``T >= 1``.
            return_hidden: also return the last-layer features ``[B, T, hidden]`` (drafter
                training reads them).
        Returns:
            ``[B, T, vocab]`` logits in the activation dtype (and the features); differentiable
            with respect to the model's parameters when built with ``differentiable=True``.
        Discards any batch the adapter held.
        """
        self.pending = None
        self._empty_state(0)
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        tokens = tokens.to(self.device)
        B = tokens.shape[0]
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            x = self.embed_weight[tokens]
            for L in self.layers:
                h = rms_norm(x, L.attn_norm, L.attn_eps)
                conv = (lambda p: causal_conv(p, L.conv_w, L.conv_b)) if self.conv_width else None  # noqa: B023
                _, q, k, v, g, beta, _ = self._mixer_inputs(L, h, conv)
                S0 = torch.zeros(B, L.HV, L.K, L.V, dtype=self.state_dtype, device=self.device)
                o, _ = chunk_gdn(q, k, v, g, beta, S0, L.K**-0.5, PREFILL_CHUNK)
                x = self._mixer_output_and_mlp(L, x, h, o)
            logits = self.lm_logits(x)
        return (logits, x) if return_hidden else logits
