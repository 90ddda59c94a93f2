"""Registers the ``retention`` architecture with specla (entry point in pyproject.toml)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specla.errors import UnsupportedModelError
from specla.hookspecs import hookimpl
from specla.interfaces import ArchitecturePlugin
from specla.model.spec import ModelSpec, Placement

from .model import RetentionConfig, RetentionModel

TINY_VARIANTS = {"base": {}, "odd": dict(hidden_size=15, num_heads=3, head_dim=5, num_layers=3, vocab_size=37),
                 # a hybrid: softmax attention between retention layers (specla's attention mixer)
                 "hybrid": dict(num_layers=3, layer_types=["retention", "attention", "retention"])}


class RetentionPlugin(ArchitecturePlugin):
    """Multi-scale retention (RetNet-style scalar-decay linear attention), pure or hybrid with
    softmax attention layers."""

    name = "retention"
    model_types = ("tiny_retention",)
    capabilities = frozenset({"trees", "cuda_graphs"})
    tiny_variants = tuple(TINY_VARIANTS)

    def load_model(self, path: Path, *, dtype: torch.dtype | None, device: str | None) -> torch.nn.Module:
        cfg = Path(path) / "config.json"
        if not cfg.is_file() or json.loads(cfg.read_text()).get("model_type") not in self.model_types:
            raise UnsupportedModelError(f"{path} is not a tiny_retention checkpoint")
        model = RetentionModel.load(path)
        return model.to(device or "cpu", dtype or torch.float32)

    def check_model(self, model: torch.nn.Module) -> None:
        self.require_class(model, (RetentionModel,))

    def model_spec(self, model: torch.nn.Module, placement: Placement) -> ModelSpec:
        from .spec import retention_spec

        return retention_spec(model, placement)

    def tiny_model(self, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = RetentionModel(RetentionConfig(**TINY_VARIANTS[variant]))
        with torch.no_grad():  # larger weights than nn.Linear's default, so tokens differ sharply
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.5)
        return model.to(dtype).eval()

    def reference_decode(self, model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        """One token at a time with the plain recurrence ``S = gamma S + k v^T``, ``o = S^T q``, and
        in attention layers a softmax over every key so far."""
        cfg = model.config
        ct = torch.float64 if model.lm_head.weight.dtype == torch.float64 else torch.float32
        gamma = torch.exp(model.log_gamma.to(ct))[:, None, None]
        S = [torch.zeros(cfg.num_heads, cfg.head_dim, cfg.head_dim, dtype=ct) for _ in model.layers]
        keys = [[] for _ in model.layers]  # attention layers: every token's (k, v) so far

        def rms(x, w):
            x = x.to(ct)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(ct)

        def step(token: int) -> torch.Tensor:
            x = model.embed.weight[token].to(ct)
            for li, layer in enumerate(model.layers):
                h = rms(x, layer.norm)
                q, k, v = ((h @ lin.weight.to(ct).T).view(cfg.num_heads, cfg.head_dim) for lin in (layer.q, layer.k, layer.v))
                if cfg.layer_types[li] == "attention":
                    keys[li].append((k, v))
                    K, Vs = torch.stack([kv[0] for kv in keys[li]]), torch.stack([kv[1] for kv in keys[li]])
                    w = torch.softmax(torch.einsum("hd,thd->ht", q, K) * cfg.head_dim**-0.5, -1)
                    o = torch.einsum("ht,thd->hd", w, Vs)
                else:
                    S[li] = gamma * S[li] + k[:, :, None] * v[:, None, :]
                    o = torch.einsum("hkv,hk->hv", S[li], q * cfg.head_dim**-0.5)
                x = x + o.reshape(-1) @ layer.o.weight.to(ct).T
            return rms(x, model.norm) @ model.lm_head.weight.to(ct).T

        with torch.no_grad():
            for t in prompt:
                logits = step(t)
            out = []
            for _ in range(max_new_tokens):
                out.append(int(logits.argmax()))
                logits = step(out[-1])
        return out


@hookimpl
def specla_architectures() -> list[ArchitecturePlugin]:
    return [RetentionPlugin()]
