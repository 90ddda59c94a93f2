"""A tiny multi-scale retention language model (RetNet, Sun et al. 2023, arXiv 2307.08621,
without the group norm and gating): per layer ``x += Wo mix(RMSNorm(x))`` where the sequence mixer
is retention, per head ``S_t = gamma S_{t-1} + k_t v_t^T`` and ``o_t = S_t^T q_t``, or, in a
hybrid (``layer_types``), causal softmax attention without positional encoding; a final RMSNorm
and LM head.

Deliberately not a transformers model: a plugin can serve any ``torch.nn.Module``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class RetentionConfig:
    """Shape of a :class:`RetentionModel` (``model_type`` lets specla auto-detect the plugin)."""

    vocab_size: int = 61
    hidden_size: int = 24
    num_heads: int = 2
    head_dim: int = 8
    num_layers: int = 2
    layer_types: list[str] | None = None  # "retention" (default) or "attention", per layer
    eos_token_id: int | None = None
    model_type: str = "tiny_retention"

    def __post_init__(self):
        self.layer_types = list(self.layer_types or ["retention"] * self.num_layers)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"retention", "attention"}:
            raise ValueError(f"layer_types must name 'retention' or 'attention' for each of the {self.num_layers} "
                             f"layers, got {self.layer_types}")


class RetentionModel(nn.Module):
    """Weights only: the math lives in the plugin's spec (batched) and naive decoder."""

    def __init__(self, config: RetentionConfig):
        super().__init__()
        self.config = config
        D, HK = config.hidden_size, config.num_heads * config.head_dim
        self.embed = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList()
        for _ in range(config.num_layers):
            layer = nn.Module()
            layer.norm = nn.Parameter(torch.ones(D))
            layer.q, layer.k, layer.v = (nn.Linear(D, HK, bias=False) for _ in range(3))
            layer.o = nn.Linear(HK, D, bias=False)
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(D))
        self.lm_head = nn.Linear(D, config.vocab_size, bias=False)
        # RetNet's multi-scale decays: gamma_h = 1 - 2^(-5 - h)
        self.register_buffer("log_gamma", torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(config.num_heads)]))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def save_pretrained(self, directory: str | Path) -> None:
        """``config.json`` + ``model.safetensors``."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(self.config)))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(out / "model.safetensors"))

    @classmethod
    def load(cls, directory: str | Path) -> "RetentionModel":
        from safetensors.torch import load_file

        d = Path(directory)
        model = cls(RetentionConfig(**json.loads((d / "config.json").read_text())))
        model.load_state_dict(load_file(str(d / "model.safetensors")))
        return model.eval()
