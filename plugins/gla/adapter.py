"""Turns a transformers/FLA ``GLAForCausalLM`` into a :class:`specla.TargetAdapter`.

The reference path: the whole model runs layer-major over the draft tree in PyTorch from the
model's own weights (FLA's modules are Triton-only, so they cannot serve CPU users). Per layer,
following ``fla/layers/gla.py``: q/k/v projections, optional tree-aware short convolution + SiLU,
key/value/decay heads repeated to the query heads (``num_kv_heads``), the low-rank decay
``gk = logsigmoid(W2 W1 h + b2) / gate_logit_normalizer`` (then ``clamp_min``), the feature map on
q and k, tree-masked GLA with factor records, RMSNorm (gated by ``swish(g_proj h)`` with
``use_output_gate``), output projection, then the MLP; final norm and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.config import SpecConfig
from specla.layerwise import LayerwiseAdapter, eos_token_ids
from specla.records import PendingCommit, Record, path_end
from specla.tree import inclusive_ancestor_mask
from specla.ops import conv_triton as conv_kernels
from specla.ops.conv import conv_ancestors, conv_window_after, conv_windows_per_node, tree_conv
from specla.ops.norm import rms_norm

from .commit import flush_commit
from .naive import FEATURE_MAPS
from .records import GLAFactorRecord, GLAReplayRecord, GLASnapshotRecord
from .reference import gla_commit_factor, gla_commit_replay, node_states, tree_gla
from .verify import pick_verify_kernel, serial_verify, tree_verify



def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm with an optional weight (``elementwise_affine=False`` has none)."""
    return rms_norm(x, weight if weight is not None else torch.ones((), dtype=x.dtype, device=x.device), eps)


@dataclass
class _Layer:
    """One GLA block's weights, converted once to the run's device and dtype."""

    attn_norm: Tensor
    attn_eps: float
    w_qkv: Tensor  # [key_dim + (key_dim + value_dim) / groups, hidden]
    w_gk1: Tensor  # [gate_low_rank_dim, hidden]
    w_gk2: Tensor  # [key_dim / groups, gate_low_rank_dim]
    b_gk2: Tensor  # [key_dim / groups]
    w_g: Tensor | None  # [value_dim, hidden], None without output gate
    conv_w: Tensor | None  # [Dc, C]
    conv_b: Tensor | None  # [Dc]
    o_norm: Tensor | None  # [V], None with elementwise_affine=False
    o_eps: float
    w_o: Tensor  # [hidden, value_dim]
    mlp_norm: Tensor
    mlp_eps: float
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    H: int
    groups: int  # query heads per key/value head
    K: int
    V: int
    normalizer: float  # gate_logit_normalizer
    clamp_min: float | None


class GLAAdapter(LayerwiseAdapter):
    """Reference-path adapter for Gated Linear Attention (see module docstring).

    State per sequence: ``recurrent[l]`` ``[B, H, K, V]`` float32 (float64 for float64 runs),
    ``conv[l]`` ``[B, C - 1, Dc]`` activation dtype (``None`` without short conv), ``roots``
    ``[B]`` int64. Weights are read from ``model`` once; ``model`` itself is not modified.

    Args:
        model: a ``fla.models.GLAForCausalLM`` (checked by the plugin).
        config: the run's :class:`SpecConfig` (``dtype``/``device`` override the model's).
        differentiable: build the weights without detaching them, so :meth:`score` can be
            trained through.
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig, *, differentiable: bool = False):
        self.differentiable = differentiable
        ref = model.lm_head.weight
        self._place(config, ref)
        keep = (lambda p: p) if differentiable else (lambda p: p.detach())  # noqa: E731
        act = lambda p: keep(p).to(self.device, self.dtype) if p is not None else None  # noqa: E731
        st = lambda p: keep(p).to(self.device, self.state_dtype)  # noqa: E731
        m = model.model
        self.embed_weight = act(m.embeddings.weight)
        self.vocab_size = self.embed_weight.shape[0]
        self.eos_token_ids = eos_token_ids(model)
        self.norm, self.norm_eps = act(m.norm.weight), m.norm.eps
        self.lm_head = act(model.lm_head.weight)
        self.feature_map = FEATURE_MAPS[model.config.feature_map]
        self.layers = []
        for blk in m.layers:
            a = blk.attn
            conv = [a.q_conv1d, a.k_conv1d, a.v_conv1d] if a.use_short_conv else None
            onorm = a.g_norm_swish_gate if a.fuse_norm_and_gate else a.g_norm
            self.layers.append(
                _Layer(
                    attn_norm=act(blk.attn_norm.weight), attn_eps=blk.attn_norm.eps,
                    w_qkv=act(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                    w_gk1=act(a.gk_proj[0].weight), w_gk2=act(a.gk_proj[1].weight), b_gk2=st(a.gk_proj[1].bias),
                    w_g=act(a.g_proj.weight) if a.use_output_gate else None,
                    conv_w=act(torch.cat([c.weight[:, 0] for c in conv])) if conv else None,
                    conv_b=act(torch.cat([c.bias for c in conv])) if conv and conv[0].bias is not None else None,
                    o_norm=act(onorm.weight), o_eps=onorm.eps, w_o=act(a.o_proj.weight),
                    mlp_norm=act(blk.mlp_norm.weight), mlp_eps=blk.mlp_norm.eps,
                    w_gate=act(blk.mlp.gate_proj.weight), w_up=act(blk.mlp.up_proj.weight),
                    w_down=act(blk.mlp.down_proj.weight),
                    H=a.num_heads, groups=a.num_kv_groups, K=a.head_k_dim, V=a.head_v_dim,
                    normalizer=float(a.gate_logit_normalizer), clamp_min=a.clamp_min,
                )
            )
        self.conv_width = self.layers[0].conv_w.shape[1] if self.layers[0].conv_w is not None else 0
        self._init_state()

    # ------------------------------------------------------------------ state
    def _empty_state(self, B: int) -> None:
        self.recurrent = [
            torch.zeros(B, L.H, L.K, L.V, dtype=self.state_dtype, device=self.device) for L in self.layers
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

    def _kernel_verify(self, q, k, v, gk, S0, parents, counts, mask, scale, pending):
        """Dispatch to the serial or parallel verify kernel (``SpecConfig.verify_kernel``); trees
        over the kernels' size commit with the flush kernel, then verify on the reference path."""
        choice = self._kernel_choice(pick_verify_kernel, parents, counts)
        if choice == "serial":
            return serial_verify(q, k, v, gk, S0, counts, scale, pending=pending)
        if choice == "parallel":
            return tree_verify(q, k, v, gk, S0, mask, scale, pending=pending)
        if pending is not None:
            flush_commit(S0, *pending)
        return tree_gla(q, k, v, gk, S0, mask, scale)

    def _layer_inputs(self, L: _Layer, h: Tensor, conv_out: Tensor):
        """q, k, v (``[B, T, H, *]``) and the log decay gk (``[B, T, H, K]``, state dtype) of one
        layer, key/value heads repeated to the query heads (FLA's ``repeat(... (h g) d)``)."""
        B, T = h.shape[:2]
        st = self.state_dtype
        q, k, v = conv_out.split([L.H * L.K, L.H * L.K // L.groups, L.H * L.V // L.groups], dim=-1)
        gk = (h @ L.w_gk1.T) @ L.w_gk2.T
        rep = lambda x, d: x.reshape(B, T, L.H // L.groups, d).repeat_interleave(L.groups, 2)  # noqa: E731
        k, v, gk = rep(k, L.K), rep(v, L.V), rep(gk.to(st) + L.b_gk2, L.K)
        gk = F.logsigmoid(gk) / L.normalizer  # float32 end to end: never rounded to bf16
        if L.clamp_min is not None:
            gk = gk.clamp_min(L.clamp_min)
        q = self.feature_map(q.reshape(B, T, L.H, L.K).to(st))
        return q, self.feature_map(k.to(st)), v.to(st), gk

    def _forward(self, tokens: Tensor, parents: Tensor, counts: Tensor, records: str, logits: bool,
                 pending: PendingCommit | None):
        mask = inclusive_ancestor_mask(parents)
        anc = conv_ancestors(parents, self.conv_width) if self.conv_width else None
        x = self.embed_weight[tokens]
        B, T = tokens.shape
        out_records: list[Record] = []
        kernel = self._use_kernel(records)
        for li, L in enumerate(self.layers):
            prev = pending.records[li] if pending is not None else None
            if prev is not None and self.conv[li] is not None:  # the conv window commits first
                self.conv[li] = self._conv_commit(kernel)(prev.conv_x, self.conv[li], pending.path, pending.path_len)
            if prev is not None and not kernel:
                self.recurrent[li] = gla_commit_factor(self.recurrent[li], prev.k, prev.v, prev.Gk,
                                                       pending.path, pending.path_len)
            h = rms_norm(x, L.attn_norm, L.attn_eps)
            proj = h @ L.w_qkv.T
            qkv = self._tree_conv(kernel)(proj, self.conv[li], L.conv_w, L.conv_b, anc) if anc is not None else proj
            q, k, v, gk = self._layer_inputs(L, h, qkv)
            S0 = self.recurrent[li]
            if kernel:  # fused: the kernel applies the pending commit to S0 in place, then verifies
                fused = None if prev is None else (prev.k, prev.v, prev.Gk, pending.path, pending.path_len)
                o, Gk = self._kernel_verify(q, k, v, gk, S0, parents, counts, mask, L.K**-0.5, fused)
            else:
                o, Gk = tree_gla(q, k, v, gk, S0, mask, L.K**-0.5)
            conv_x = proj if anc is not None else None
            if records == "factor":
                out_records.append(GLAFactorRecord(k=k, v=v, Gk=Gk, conv_x=conv_x))
            elif records == "snapshot":
                wins = conv_windows_per_node(proj, self.conv[li], anc) if anc is not None else None
                out_records.append(GLASnapshotRecord(node_states(S0, k, v, Gk, mask), wins))
            else:
                out_records.append(GLAReplayRecord(k=k, v=v, gk=gk, conv_x=conv_x))
            o = _rms(o, L.o_norm, L.o_eps)
            if L.w_g is not None:  # FusedRMSNormGated(swish), or g_norm then gate_fn = swish
                o = o * F.silu((h @ L.w_g.T).view(B, T, L.H, L.V).to(o.dtype))
            x = x + o.reshape(B, T, -1).to(self.dtype) @ L.w_o.T
            h = rms_norm(x, L.mlp_norm, L.mlp_eps)
            x = x + (F.silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
        out = self.lm_logits(x) if logits else None
        return out, x, tuple(out_records)

    @staticmethod
    def _tree_conv(kernel: bool):
        return conv_kernels.tree_conv if kernel else tree_conv

    @staticmethod
    def _conv_commit(kernel: bool):
        return conv_kernels.conv_commit if kernel else conv_window_after

    def _apply(self, records: tuple[Record, ...], path: Tensor, path_len: Tensor) -> None:
        """Commit ``path`` (``[B, P]``, ``path_len [B]``) to every layer from its records."""
        end = path_end(path, path_len)
        for li, rec in enumerate(records):
            S0, win = self.recurrent[li], self.conv[li]
            if isinstance(rec, GLAFactorRecord) and self._use_kernel("factor"):
                flush_commit(S0, rec.k, rec.v, rec.Gk, path, path_len)  # in place
            elif isinstance(rec, GLAFactorRecord):
                self.recurrent[li] = gla_commit_factor(S0, rec.k, rec.v, rec.Gk, path, path_len)
            elif isinstance(rec, GLAReplayRecord):
                self.recurrent[li] = gla_commit_replay(S0, rec.k, rec.v, rec.gk, path, path_len)
            else:
                picked = rec.states[torch.arange(S0.shape[0], device=S0.device), end.clamp(min=0)]
                self.recurrent[li] = torch.where((path_len > 0)[:, None, None, None], picked, S0)
            if win is None:
                continue
            if isinstance(rec, GLASnapshotRecord):
                picked = rec.conv_windows[torch.arange(win.shape[0], device=win.device), end.clamp(min=0)]
                self.conv[li] = torch.where((path_len > 0)[:, None, None], picked, win)
            else:
                self.conv[li] = conv_window_after(rec.conv_x, win, path, path_len)
