"""Speculative decoding of :class:`RetentionModel` through specla's contract.

Tree-masked retention (scalar decay per head, no delta correction): with ``G_i = depth_i *
log gamma`` the log decay summed along node ``i``'s root path and ``M`` the inclusive-ancestor
mask, ``o_i = exp(G_i) q_i S0 + sum_j M_ij exp(G_i - G_j) (q_i . k_j) v_j``: every node sees
exactly its own path. The factor record is ``(k, v, G)``; committing the accepted path ending at
node ``a`` is ``S = exp(G_a) S0 + sum_{j on path} exp(G_a - G_j) k_j v_j^T`` (docs/DESIGN.md
sections 3 and 5, scalar-decay case). Only the ``factor`` commit is implemented, applied at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specla.config import SpecConfig
from specla.errors import UnsupportedModelError
from specla.interfaces import TargetAdapter, VerifyOutput
from specla.layerwise import eos_token_ids
from specla.ops.norm import rms_norm
from specla.records import Acceptance, Record, path_end
from specla.tree import DraftTree, inclusive_ancestor_mask

CHUNK = 64  # prompt tokens per prefill pass


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


class RetentionAdapter(TargetAdapter):
    """Batched tree verify and factor commit for :class:`RetentionModel` (float32 or float64
    states: the model's dtype, at least float32).

    Raises:
        UnsupportedModelError: a commit strategy other than ``factor``.
    """

    def __init__(self, model, config: SpecConfig):
        if config.commit != "factor":
            raise UnsupportedModelError(f"the retention example implements only the factor commit, not {config.commit!r}")
        self.config = config
        self.model = model
        ref = model.lm_head.weight
        self.device = torch.device(config.device) if config.device else ref.device
        self.dtype = getattr(torch, config.dtype) if config.dtype else ref.dtype
        self.state_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = eos_token_ids(model)
        self.H, self.K = model.config.num_heads, model.config.head_dim
        self.w = {n: p.detach().to(self.device, self.dtype) for n, p in model.named_parameters()}
        self.log_gamma = model.log_gamma.to(self.device, self.state_dtype)
        self.S: list[Tensor] = []
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.last_hidden = torch.zeros(0, model.config.hidden_size, dtype=self.dtype, device=self.device)

    @property
    def batch_size(self) -> int:
        return self._roots.shape[0]

    @property
    def roots(self) -> Tensor:
        return self._roots

    def _forward(self, tokens: Tensor, parents: Tensor):
        """Logits ``[B, T, vocab]``, features and one factor record per layer for a batch of trees."""
        mask = inclusive_ancestor_mask(parents)
        B, T = tokens.shape
        x = self.w["embed.weight"][tokens]
        records = []
        for li, S0 in enumerate(self.S):
            p = f"layers.{li}."
            h = rms_norm(x, self.w[p + "norm"], 1e-6)
            q, k, v = ((h @ self.w[p + n + ".weight"].T).view(B, T, self.H, self.K).to(self.state_dtype)
                       for n in ("q", "k", "v"))
            o, G = tree_retention(q * self.K**-0.5, k, v, self.log_gamma, S0, mask)
            records.append(RetentionFactorRecord(k=k, v=v, G=G))
            x = x + o.reshape(B, T, -1).to(self.dtype) @ self.w[p + "o.weight"].T
        return rms_norm(x, self.w["norm"], 1e-6) @ self.w["lm_head.weight"].T, x, tuple(records)

    def _apply(self, records, path: Tensor, path_len: Tensor) -> None:
        self.S = [commit_factor(S, rec, path, path_len) for S, rec in zip(self.S, records)]

    @torch.no_grad()
    def _prefill(self, prompts: list[list[int]]) -> None:
        B, L = len(prompts), self.model.config.num_layers
        self.S = [torch.zeros(B, self.H, self.K, self.K, dtype=self.state_dtype, device=self.device) for _ in range(L)]
        self.last_hidden = torch.zeros(B, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        bodies = [p[:-1] for p in prompts]
        lengths = torch.tensor([len(b) for b in bodies], device=self.device)
        T = max(len(b) for b in bodies)
        tokens = torch.tensor([b + [0] * (T - len(b)) for b in bodies], dtype=torch.int64, device=self.device)
        for start in range(0, T, CHUNK):  # each chunk is a chain; only each row's real tokens commit
            chunk = tokens[:, start : start + CHUNK]
            W = chunk.shape[1]
            n = (lengths - start).clamp(0, W)
            _, hidden, recs = self._forward(chunk, torch.arange(-1, W - 1, device=self.device).expand(B, W))
            path = torch.where(torch.arange(W, device=self.device) < n[:, None], torch.arange(W, device=self.device), -1)
            self._apply(recs, path, n)
            last = hidden[torch.arange(B, device=self.device), (n - 1).clamp(min=0)]
            self.last_hidden = torch.where((n > 0)[:, None], last, self.last_hidden)
        self._roots = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def _verify(self, tree: DraftTree) -> VerifyOutput:
        tokens = torch.cat([self._roots[:, None], tree.tokens], 1)
        logits, hidden, records = self._forward(tokens, tree.parents_with_root)
        return VerifyOutput(logits=logits, hidden=hidden, records=records)

    @torch.no_grad()
    def _commit(self, tree: DraftTree, out: VerifyOutput, acceptance: Acceptance) -> None:
        self._apply(out.records, acceptance.path.to(self.device), acceptance.path_len.to(self.device))
        self._roots = acceptance.bonus.to(self.device)

    def flush(self) -> None:
        """Nothing is ever pending: commits are applied at once."""

    def select(self, index: Tensor) -> None:
        index = index.to(self.device)
        self.S = [s.index_select(0, index) for s in self.S]
        self._roots = self._roots.index_select(0, index)
        self.last_hidden = self.last_hidden.index_select(0, index)

    def recurrent_states(self) -> list[Tensor]:
        return list(self.S)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.w["embed.weight"][tokens]

    def lm_logits(self, hidden: Tensor) -> Tensor:
        return rms_norm(hidden, self.w["norm"], 1e-6) @ self.w["lm_head.weight"].T
