"""The model's own drafter: the multi-token-prediction (MTP) layer Qwen3.5 and Qwen3-Next checkpoints
ship (``mtp.*`` tensors, which transformers does not load), as ``drafter="mtp"``.

The MTP layer reads the target's final-normed feature ``f_p`` and the embedding of the next token
``x_{p+1}`` and predicts the token after it (Qwen3-Next / DeepSeek-V3 MTP, as vLLM and SGLang run
it): ``h = fc([norm_e(embed(x_{p+1})) ; norm_h(f_p)])``, one decoder layer of the model's own
full-attention kind over the pairs so far (gated attention with q/k norms and the model's partial
rotary embedding at position ``p``, then the MLP or MoE), ``f' = norm(h)``, logits ``lm_head(f')``
(the target's LM head, no further norm). Deeper draft levels feed ``f'`` back in. This is the
EAGLE drafter's shape (:class:`specla.drafters.eagle.EagleDrafter`: a cache of the accepted pairs'
keys and values following the accepted path, trees by the confidence-pruned builder), so
:class:`MTPDrafter` subclasses it and replaces the head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from specla.drafters.eagle import EagleDrafter
from specla.errors import DrafterError
from specla.interfaces import TargetAdapter
from specla.ops.attention import draft_attention

from .adapter import QwenAttention, decoder_layer, text_parts


def mtp_tensors(directory: str | Path) -> dict[str, Tensor]:
    """Every ``mtp.*`` tensor of a checkpoint directory's safetensors files, prefix removed.

    Raises:
        DrafterError: no such directory, or no ``mtp.*`` tensor in it.
    """
    from safetensors import safe_open

    d = Path(directory)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else []
    out: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.startswith("mtp."):
                    out[key[4:]] = st.get_tensor(key)
    if not out:
        raise DrafterError(f"drafter='mtp' reads the checkpoint's mtp.* tensors, and {d} holds none"
                           + ("" if files else " (no safetensors files there)")
                           + ": load the model from a checkpoint directory that ships its MTP layer")
    return out


class QwenMTPHead(nn.Module):
    """The MTP layer, built from the target's own classes (its decoder-layer class of the
    full-attention kind, its RMSNorm) and loaded from the checkpoint's ``mtp.*`` tensors.

    Args:
        model: the target (its text config and classes are read).
        tensors: the ``mtp.*`` tensors without the prefix (``fc.weight``,
            ``pre_fc_norm_embedding.weight``, ``pre_fc_norm_hidden.weight``, ``layers.0.*``,
            ``norm.weight``).
    Raises:
        DrafterError: the tensors do not fit the model's MTP layer (missing or unexpected names,
            wrong shapes), or the model has no full-attention layer to copy the kind from.
    """

    def __init__(self, model: nn.Module, tensors: dict[str, Tensor]):
        super().__init__()
        text, _ = text_parts(model)
        cfg = text.config
        try:
            li = list(cfg.layer_types).index("full_attention")
        except ValueError as err:
            raise DrafterError("the model has no full_attention layer to build its MTP layer from") from err
        layer_cls, norm_cls = type(text.layers[li]), type(text.norm)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (norm_cls(H, eps=eps) for _ in range(3))
        self.layers = nn.ModuleList([layer_cls(cfg, li)])
        try:
            self.load_state_dict(tensors)
        except RuntimeError as err:
            raise DrafterError(f"the checkpoint's mtp.* tensors do not fit {type(model).__name__}'s MTP layer: "
                               f"{err}") from err

    def pair(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """``fc([norm_e(e) ; norm_h(f)])``: ``[..., hidden]``."""
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embedding), self.pre_fc_norm_hidden(feature)], -1))


class MTPDrafter(EagleDrafter):
    """Draft chains and trees from the checkpoint's MTP layer (see the module docstring).

    State as :class:`EagleDrafter`'s, with the MTP attention's key/value heads in the cache.
    The draft levels run on PyTorch (its grouped-query attention has no Triton form yet).

    Args:
        head: a :class:`QwenMTPHead`.
        model: the target it belongs to (its final norm, rotary module and LM head are used).
    """

    name = "mtp"

    def __init__(self, head: QwenMTPHead, model: nn.Module):
        super().__init__(head)
        self.model = model

    @classmethod
    def from_model(cls, model: nn.Module) -> "MTPDrafter":
        """The MTP layer of the checkpoint ``model`` was loaded from (``config._name_or_path``).

        Raises:
            DrafterError: the model does not name a checkpoint directory with ``mtp.*`` tensors.
        """
        source = getattr(text_parts(model)[0].config, "_name_or_path", "") or getattr(model.config, "_name_or_path", "")
        if not source or not Path(source).is_dir():
            raise DrafterError("drafter='mtp' reads the MTP layer from the checkpoint directory the model was loaded "
                               f"from, and this model names none ({source!r}): load it with from_pretrained(DIR) or "
                               "pass DIR to specla")
        return cls(QwenMTPHead(model, mtp_tensors(source)), model)

    def bind(self, adapter: TargetAdapter) -> None:
        self.adapter = adapter
        self.head = self.head.to(adapter.device, adapter.dtype).eval()
        self.text, self.lm_head = text_parts(getattr(adapter, "model", self.model))
        layer = self.head.layers[0]
        self.attn = QwenAttention(layer.self_attn, self.text.rotary_emb, adapter.dtype, adapter.device)
        self.kernels = False

    def _cache_heads(self) -> tuple[int, int]:
        return self.attn.HKV, self.attn.Dh

    def _root_state(self) -> Tensor:
        return self.feature

    def _features(self, hidden: Tensor) -> Tensor:
        return self.text.norm(hidden)  # the MTP layer reads final-normed target features

    def _pair_kv(self, feats: Tensor, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        h = self.head.pair(feats, self.adapter.embed(tokens))
        _, k, v, _ = self.attn.project(self.head.layers[0].input_layernorm(h), positions)
        return k, v

    def _logits(self, feature: Tensor) -> Tensor:
        return self.lm_head(feature)

    def _level(self, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One draft level. ``state [B, M, hidden + 2 A kv]``: the parents' features, then the
        keys and values of their ``A`` ancestors (``kv = HKV Dh``, flattened). Nodes sit at
        position ``cache_len + A`` (the pair of a feature at position ``p`` is at ``p``)."""
        B, M, S = state.shape[:3]
        H = self.head.fc.out_features
        HKV, Dh = self._cache_heads()
        A = (S - H) // (2 * HKV * Dh)
        positions = (self.cache_len + A)[:, None].expand(B, M)
        shape = (B, M, A, HKV, Dh)
        anc_k, anc_v = state[..., H : H + A * HKV * Dh].reshape(shape), state[..., H + A * HKV * Dh :].reshape(shape)
        kv = []

        def attend(n: Tensor) -> Tensor:  # over the cache, the ancestors and the node itself
            q, k, v, gate = self.attn.project(n, positions)
            kv.extend([torch.cat([anc_k, k[:, :, None]], 2), torch.cat([anc_v, v[:, :, None]], 2)])
            o = draft_attention(q, self.cache_k, self.cache_v, self.cache_len, *kv).to(n.dtype)
            return self.attn.output(o, gate)

        x = decoder_layer(self.head.layers[0], self.head.pair(state[..., :H], self.adapter.embed(tokens)), attend)
        new = self.head.norm(x)
        keys, values = kv
        return torch.cat([new, keys.flatten(2), values.flatten(2)], -1), new
