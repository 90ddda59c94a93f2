"""Speculative decoding of :class:`RetentionModel` on specla's mixer core.

Each layer's sequence mixer is a :class:`RetentionMixer` (below) or, in a hybrid, specla's
:class:`~specla.mixers.AttentionMixer` with this model's projections; :func:`retention_spec`
wires them with the model's norms into a :class:`~specla.model.spec.ModelSpec`, and specla's
adapter runs prefill, verify, the delayed commit, batch selection and CUDA-graph state.

Tree-masked retention (scalar decay per head, no delta correction): with ``G_i = depth_i *
log gamma`` the log decay summed along node ``i``'s root path and ``M`` the inclusive-ancestor
mask, ``o_i = exp(G_i) q_i S0 + sum_j M_ij exp(G_i - G_j) (q_i . k_j) v_j``: every node sees
exactly its own path. The factor record is ``(k, v, G)``; committing the accepted path ending at
node ``a`` is ``S = exp(G_a) S0 + sum_{j on path} exp(G_a - G_j) k_j v_j^T`` (docs/DESIGN.md
sections 3 and 5, scalar-decay case). Only the ``factor`` commit is implemented.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from specla.hf import eos_token_ids
from specla.mixers import AttentionMixer, Mixer, TreePass
from specla.model.spec import ModelSpec, Placement, rms_head
from specla.ops.norm import rms_norm
from specla.records import LayerCommit, Record, path_end


@dataclass(frozen=True)
class RetentionFactorRecord(Record):
    k: Tensor  # [B, T, H, K] keys
    v: Tensor  # [B, T, H, V] values
    G: Tensor  # [B, T, H] log decay summed along each node's root path


def tree_retention(q: Tensor, k: Tensor, v: Tensor, log_gamma: Tensor, S0: Tensor, mask: Tensor):
    """Outputs ``[B, T, H, V]`` and ``G [B, T, H]`` of a batch of trees (module docstring).

    Args: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; log_gamma ``[H]``; S0 ``[B, H, K, V]``;
        mask ``[B, T, T]`` bool inclusive-ancestor mask.
    """
    G = mask.sum(-1, dtype=S0.dtype)[..., None] * log_gamma  # [B, T, H]
    Gh = G.transpose(1, 2)  # [B, H, T]
    decay = torch.exp(torch.where(mask[:, None], Gh[..., :, None] - Gh[..., None, :], float("-inf")))
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, .]
    o = torch.exp(Gh)[..., None] * (qh @ S0) + ((qh @ kh.transpose(-1, -2)) * decay) @ vh
    return o.transpose(1, 2), G


def commit_factor(S0: Tensor, rec: RetentionFactorRecord, path: Tensor, path_len: Tensor) -> Tensor:
    """State after the accepted ``path`` (``[B, P]``, ``-1`` padded; ``path_len [B]``); rows with
    ``path_len == 0`` keep ``S0`` bit-identical."""
    end = path_end(path, path_len).clamp(min=0)
    rows = torch.arange(S0.shape[0], device=S0.device)
    Ga = rec.G[rows, end]  # [B, H]
    idx = path.clamp(min=0)
    w = torch.exp(torch.where((path >= 0)[..., None], Ga[:, None] - rec.G[rows[:, None], idx], float("-inf")))
    kp, vp = rec.k[rows[:, None], idx], rec.v[rows[:, None], idx]  # [B, P, H, .]
    S = torch.exp(Ga)[..., None, None] * S0 + torch.einsum("bph,bphk,bphv->bhkv", w, kp, vp)
    return torch.where((path_len > 0)[:, None, None, None], S, S0)


class RetentionMixer(Mixer):
    """One retention layer's mixer: state ``S [B, H, K, K]`` in ``state_dtype``."""

    def __init__(self, layer, log_gamma: Tensor, H: int, K: int, dtype, state_dtype, device):
        self.layer, self.log_gamma, self.H, self.K = layer, log_gamma, H, K
        self.dtype, self.state_dtype, self.device = dtype, state_dtype, device
        self.empty_state(0, 0)

    def empty_state(self, B: int, capacity: int) -> None:
        self.S = torch.zeros(B, self.H, self.K, self.K, dtype=self.state_dtype, device=self.device)

    def state(self) -> list[Tensor]:
        return [self.S]

    def empty_record(self, B: int, T: int) -> RetentionFactorRecord:
        z = lambda *s: torch.zeros(B, T, *s, dtype=self.state_dtype, device=self.device)  # noqa: E731
        return RetentionFactorRecord(k=z(self.H, self.K), v=z(self.H, self.K), G=z(self.H))

    def set_state(self, tensors: Iterator[Tensor]) -> None:
        self.S = next(tensors)

    def recurrent_states(self) -> list[Tensor]:
        return [self.S]

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None):
        if pending is not None:  # the delayed commit of the previous step
            self.commit(pending, tp.kernels)
        B, T = h.shape[:2]
        q, k, v = (lin(h).view(B, T, self.H, self.K).to(self.state_dtype)
                   for lin in (self.layer.q, self.layer.k, self.layer.v))
        o, G = tree_retention(q * self.K**-0.5, k, v, self.log_gamma, self.S, tp.mask)
        return self.layer.o(o.reshape(B, T, -1).to(self.dtype)), RetentionFactorRecord(k=k, v=v, G=G)

    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        self.S = commit_factor(self.S, pending.record, pending.path, pending.path_len)


class PlainAttention(AttentionMixer):
    """A hybrid's attention layer: ``q, k, v`` projections, no positional encoding (the
    retention layers carry order), ``o`` projection; every node attends to the KV cache and its
    own ancestors (specla's tree attention)."""

    def __init__(self, layer, H: int, K: int, dtype, device):
        self.layer, self.H = layer, H
        super().__init__(H, K, dtype, device)

    def project(self, h: Tensor, positions: Tensor):
        B, T = h.shape[:2]
        q, k, v = (lin(h).view(B, T, self.H, self.Dh) for lin in (self.layer.q, self.layer.k, self.layer.v))
        return q, k, v, None

    def output(self, o: Tensor, gate: Tensor | None) -> Tensor:
        return self.layer.o(o.reshape(*o.shape[:2], -1))


def retention_spec(model, placement: Placement) -> ModelSpec:
    """:class:`RetentionModel` as a :class:`ModelSpec`: float32 or float64 states (the model's
    dtype, at least float32), a pre-norm and residual around each layer's mixer."""
    c, dtype, state_dtype, device = model.config, placement.dtype, placement.state_dtype, placement.device
    log_gamma = model.log_gamma.to(device, state_dtype)
    layers = model.layers

    def block(li: int, x: Tensor, mix, kernels: bool) -> Tensor:
        return x + mix(rms_norm(x, layers[li].norm, 1e-6))

    mixers = tuple(RetentionMixer(layer, log_gamma, c.num_heads, c.head_dim, dtype, state_dtype, device)
                   if kind == "retention" else PlainAttention(layer, c.num_heads, c.head_dim, dtype, device)
                   for layer, kind in zip(layers, c.layer_types))
    return ModelSpec(model=model, embed_weight=model.embed.weight.detach(),
                     logits=rms_head(placement, model.norm.detach(), 1e-6, model.lm_head.weight.detach()),
                     mixers=mixers, block=block, num_layers=len(mixers), eos_token_ids=eos_token_ids(model))
