"""Kimi Delta Attention (KDA, Kimi team 2025, "Kimi Linear") as a sequence mixer
(:class:`specla.mixers.Mixer`), with its records, factorized reference (``reference``) and
token-by-token twins (``naive``) and Triton kernels (``verify``, ``commit``)."""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from specla.baselines import ReplayRecord
from specla.mixers import RecurrentMixer, TreePass
from specla.ops import fla_installed, kernels
from specla.ops.conv import conv_window_after, tree_conv
from specla.records import LayerCommit, Record

from .naive import kda_commit_replay
from .records import KDAFactorRecord
from .reference import kda_commit_factor, kda_node_states, tree_kda

conv_kernels = kernels("specla.ops.conv_triton")
verify_kernels = kernels("specla.mixers.kda.verify")
commit_kernels = kernels("specla.mixers.kda.commit")


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

    baselines = frozenset({"snapshot", "replay"})
    replay_commit = staticmethod(kda_commit_replay)  # a replay record's inputs: k, v, g, beta

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

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        kernel = tp.kernels
        # one kernel for every layer of the pass, chosen once (the rule may read the tree on the host)
        choice = tp.shared("kda-kernel", lambda: tp.choose(verify_kernels.pick_verify_kernel)) if kernel else "reference"
        fused = None  # the delayed commit of the previous step: fused into the verify kernels
        if pending is not None and choice == "reference":
            self.commit(pending, kernel)
        elif pending is not None:
            self.commit_window(pending.record.conv_x, pending.path, pending.path_len, True)
            fused = pending
        m, (B, T), H, D, st = self.m, h.shape[:2], self.H, self.D, self.state_dtype
        mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], -1)
        anc = tp.conv_ancestors(self.C)
        conv = conv_kernels.tree_conv if kernel else tree_conv
        q, k, v = conv(mixed, self.conv, self.conv_w, self.conv_b, anc).split(H * D, dim=-1)
        # float32 (or wider) from here, as transformers' KDA: norms, decays and the state
        q = self.l2norm(q.reshape(B, T, H, D).to(st), dim=-1, eps=1e-6) * D**-0.5
        k = self.l2norm(k.reshape(B, T, H, D).to(st), dim=-1, eps=1e-6)
        v = v.reshape(B, T, H, D).to(st)
        g, beta = m.forget_gate(h).to(st), torch.sigmoid(m.b_proj(h)).to(st)
        if choice == "serial":  # the kernels apply the pending commit to S in place, then verify
            o, delta, Gk = verify_kernels.serial_verify(q, k, v, g, beta, self.S, tp.counts, pending=fused)
        elif choice == "parallel":
            o, delta, Gk = verify_kernels.tree_verify(q, k, v, g, beta, self.S, tp.mask, pending=fused)
        else:  # the reference path, or a tree over the kernels' size
            o, delta, Gk = tree_kda(q, k, v, g, beta, self.S, tp.mask)
        if tp.records == "replay":
            rec = ReplayRecord((k, v, g, beta), mixed)
        else:
            rec = KDAFactorRecord(k=k, delta=delta, Gk=Gk, conv_x=mixed)
        gate = m.g_b_proj(m.g_a_proj(h)).view(B, T, H, D)
        return m.o_proj(m.o_norm(o.to(h.dtype), gate).reshape(B, T, -1)), rec

    def node_states(self, record: KDAFactorRecord, tp: TreePass) -> list[Tensor]:
        return [kda_node_states(self.S, record.k, record.delta, record.Gk, tp.mask),
                *self.window_states(record.conv_x, tp)]

    def prefills_whole(self, kernels: bool) -> bool:
        # FLA's chunk kernels run on a GPU (their autotuner needs a driver), with or without
        # specla's verify kernels
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

    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        record, path, path_len = pending
        if kernels:
            commit_kernels.flush_commit(self.S, pending)  # in place
        else:
            self.S = kda_commit_factor(self.S, record.k, record.delta, record.Gk, path, path_len)
        self.commit_window(record.conv_x, path, path_len, kernels)
