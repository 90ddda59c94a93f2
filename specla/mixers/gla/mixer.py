"""Gated Linear Attention as a sequence mixer (:class:`specla.mixers.Mixer`), with its records,
reference path and Triton kernels (this package's ``records``, ``reference``, ``verify`` and
``commit``).

Shapes: ``B`` sequences, ``T`` verified nodes (root explicit), ``H`` query heads, ``groups``
query heads per key/value head, ``K``/``V`` head dims, ``Dc = H K + (H K + H V) / groups`` conv
channels (q, k, v before the conv), ``C`` conv width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from specla.baselines import ReplayRecord
from specla.mixers import RecurrentMixer, TreePass
from specla.ops import fla_installed, kernels
from specla.ops.conv import tree_conv
from specla.records import LayerCommit, Record

from .records import GLAFactorRecord
from .reference import gla_commit_factor, gla_commit_replay, node_states, tree_gla

conv_kernels = kernels("specla.ops.conv_triton")
verify_kernels = kernels("specla.mixers.gla.verify")
commit_kernels = kernels("specla.mixers.gla.commit")


class GLAMixer(RecurrentMixer):
    """One GLA layer's sequence mixer (Yang et al. 2024, arXiv 2312.06635; ``fla/layers/gla.py``):
    q/k/v projections, optional tree-aware short conv + SiLU, key/value/decay heads repeated to
    the query heads, the low-rank decay ``gk = logsigmoid(W2 W1 h + b2) / normalizer`` (then
    ``clamp_min``), the feature map on q and k, the tree-masked GLA recurrence with records of the
    pass's kind (docs/DESIGN.md), then ``output(o, gate)``.

    State: ``S [B, H, K, V]`` in ``state_dtype`` and the conv window ``[B, C - 1, Dc]`` (``None``
    without short conv) in the activation dtype.

    Args:
        project: ``h [B, T, hidden] -> (qkv [B, T, Dc], gk [B, T, H K / groups] before its bias,
            gate [B, T, H V] or None)``: the layer's input projections.
        conv_w, conv_b: ``[Dc, C]`` and ``[Dc]`` (or ``None``: no short conv, no activation).
        b_gk: ``[H K / groups]`` decay bias in ``state_dtype``. normalizer, clamp_min: the decay's.
        feature_map: applied to q and k (FLA's ``feature_map`` option).
        H, groups, K, V: heads and dims.
        output: ``(o [B, T, H, V] state dtype, gate) -> [B, T, hidden]``: the output norm, gate
            and projection.
        dtype, state_dtype, device: activations, recurrent state, device.
    """

    baselines = frozenset({"snapshot", "replay"})
    replay_commit = staticmethod(gla_commit_replay)  # a replay record's inputs: k, v, gk

    def __init__(self, *, project: Callable[[Tensor], tuple], conv_w: Tensor | None, conv_b: Tensor | None,
                 b_gk: Tensor, normalizer: float, clamp_min: float | None, feature_map: Callable[[Tensor], Tensor],
                 H: int, groups: int, K: int, V: int, output: Callable[[Tensor, Tensor | None], Tensor],
                 dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device):
        self.project, self.output, self.feature_map = project, output, feature_map
        self.conv_w, self.conv_b, self.b_gk = conv_w, conv_b, b_gk
        self.normalizer, self.clamp_min = normalizer, clamp_min
        self.H, self.groups, self.K, self.V = H, groups, K, V
        self.dtype, self.state_dtype, self.device = dtype, state_dtype, device
        self.C = conv_w.shape[1] if conv_w is not None else 0
        self.Dc = H * K + (H * K + H * V) // groups  # conv channels: q, then k and v of the key/value heads
        self.empty_state(0, 0)

    def empty_record(self, B: int, T: int) -> GLAFactorRecord:
        z = lambda *s, dtype=self.state_dtype: torch.zeros(B, T, *s, dtype=dtype, device=self.device)  # noqa: E731
        return GLAFactorRecord(k=z(self.H, self.K), v=z(self.H, self.V), Gk=z(self.H, self.K),
                               conv_x=z(self.Dc, dtype=self.dtype) if self.C else None)

    def empty_state(self, B: int, capacity: int) -> None:
        self.S = torch.zeros(B, self.H, self.K, self.V, dtype=self.state_dtype, device=self.device)
        self.conv = torch.zeros(B, self.C - 1, self.Dc, dtype=self.dtype, device=self.device) if self.C else None

    def _inputs(self, qkv: Tensor, gk: Tensor):
        """q, k, v (``[B, T, H, *]``) and the log decay (``[B, T, H, K]``, state dtype), key/value
        heads repeated to the query heads (FLA's ``repeat(... (h g) d)``)."""
        B, T = qkv.shape[:2]
        H, g, K, V, st = self.H, self.groups, self.K, self.V, self.state_dtype
        q, k, v = qkv.split([H * K, H * K // g, H * V // g], dim=-1)
        rep = lambda x, d: x.reshape(B, T, H // g, d).repeat_interleave(g, 2)  # noqa: E731
        k, v, gk = rep(k, K), rep(v, V), rep(gk.to(st) + self.b_gk, K)
        gk = F.logsigmoid(gk) / self.normalizer  # float32 end to end: never rounded to bf16
        if self.clamp_min is not None:
            gk = gk.clamp_min(self.clamp_min)
        return self.feature_map(q.reshape(B, T, H, K).to(st)), self.feature_map(k.to(st)), v.to(st), gk

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        kernel = tp.kernels
        # one kernel for every layer of the pass, chosen once (the rule may read the tree on the host)
        choice = tp.shared("gla-kernel", lambda: tp.choose(verify_kernels.pick_verify_kernel)) if kernel else "reference"
        if pending is not None:  # the conv window commits first
            prev, path, path_len = pending
            self.commit_window(prev.conv_x, path, path_len, kernel)
            if not kernel:
                self.S = gla_commit_factor(self.S, prev.k, prev.v, prev.Gk, path, path_len)
        proj, gk_raw, gate = self.project(h)
        anc = tp.conv_ancestors(self.C) if self.C else None
        qkv = (conv_kernels.tree_conv if kernel else tree_conv)(proj, self.conv, self.conv_w, self.conv_b,
                                                                anc) if anc is not None else proj
        q, k, v, gk = self._inputs(qkv, gk_raw)
        S0, scale = self.S, self.K**-0.5
        fused = pending if kernel else None
        if choice == "serial":  # the kernels apply the pending commit to S0 in place, then verify
            o, Gk = verify_kernels.serial_verify(q, k, v, gk, S0, tp.counts, scale, pending=fused)
        elif choice == "parallel":
            o, Gk = verify_kernels.tree_verify(q, k, v, gk, S0, tp.mask, scale, pending=fused)
        else:
            if fused is not None:  # a tree over the kernels' size: commit, then verify unfused
                commit_kernels.flush_commit(S0, fused)
            o, Gk = tree_gla(q, k, v, gk, S0, tp.mask, scale)
        conv_x = proj if anc is not None else None
        if tp.records == "replay":
            rec = ReplayRecord((k, v, gk), conv_x)
        else:
            rec = GLAFactorRecord(k=k, v=v, Gk=Gk, conv_x=conv_x)
        return self.output(o, gate), rec

    def node_states(self, record: GLAFactorRecord, tp: TreePass) -> list[Tensor]:
        return [node_states(self.S, record.k, record.v, record.Gk, tp.mask), *self.window_states(record.conv_x, tp)]

    def prefills_whole(self, kernels: bool) -> bool:
        # FLA's chunk kernels autotune, which needs a GPU driver (Triton's CPU interpreter has none)
        return kernels and self.device.type == "cuda" and fla_installed()

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts (:meth:`specla.mixers.Mixer.prefill`) on the kernel path: the tree
        short-conv kernel along the chain and its window commit at ``tp.counts`` (where the layer
        has a short conv), then FLA's chunked GLA (``chunk_gla``, per-key-channel decay) in float32
        from the state the layer holds (empty at a prompt's start). Padding rows get ``gk = 0`` and ``v = 0``, which leave the state as
        it is (``S <- exp(gk) * S + k v^T``)."""
        from fla.ops.gla import chunk_gla

        proj, gk_raw, gate = self.project(h)
        path, pad = tp.chain()
        qkv = proj
        if self.C:
            qkv = conv_kernels.tree_conv(proj, self.conv, self.conv_w, self.conv_b, tp.conv_ancestors(self.C))
            self.commit_window(proj, path, tp.counts, True)
        q, k, v, gk = self._inputs(qkv, gk_raw)
        gk, v = gk.masked_fill(pad[..., None, None], 0.0), v.masked_fill(pad[..., None, None], 0.0)
        o, S = chunk_gla(q, k, v, gk, scale=self.K**-0.5, initial_state=self.S, output_final_state=True)
        self.S = S.to(self.state_dtype)
        return self.output(o, gate)

    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        record, path, path_len = pending
        if kernels:
            commit_kernels.flush_commit(self.S, pending)  # in place
        else:
            self.S = gla_commit_factor(self.S, record.k, record.v, record.Gk, path, path_len)
        self.commit_window(record.conv_x, path, path_len, kernels)
