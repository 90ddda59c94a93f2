"""The model's own drafter: the multi-token-prediction (MTP) layer Qwen3.5 and Qwen3-Next checkpoints
ship (``mtp.*`` tensors, which transformers does not load), as ``drafter="mtp"``.

The MTP layer reads the target's final-normed feature ``f_p`` and the embedding of the next token
``x_{p+1}`` and predicts the token after it (Qwen3-Next / DeepSeek-V3 MTP, as vLLM and SGLang run
it): ``h = fc([norm_e(embed(x_{p+1})) ; norm_h(f_p)])``, one decoder layer of the model's own
full-attention kind over the pairs so far (gated attention with q/k norms and the model's partial
rotary embedding at position ``p``, then the MLP or MoE), ``f' = norm(h)``, logits ``lm_head(f')``
(the target's LM head, no further norm). Deeper draft levels feed ``f'`` back in. The drafter is the
core's :class:`specla.drafters.mtp.MTPDrafter` over :class:`QwenMTPHead`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from specla.drafters.mtp import MTPDrafter, MTPHead, checkpoint_directory, load_mtp_state, mtp_tensors
from specla.errors import DrafterError
from specla.model.adapter import ModelAdapter

from .spec import QwenAttention, decoder_layer, norm, text_parts


class QwenMTPHead(MTPHead):
    """The MTP layer, built from the target's own classes (its decoder-layer class of the
    full-attention kind, its RMSNorm) and loaded from the checkpoint's ``mtp.*`` tensors.

    Args:
        model: the target (its text config and classes are read).
        tensors: the ``mtp.*`` tensors without the prefix (``fc.weight``,
            ``pre_fc_norm_embedding.weight``, ``pre_fc_norm_hidden.weight``, ``layers.0.*``,
            ``norm.weight``); ``None``: the modules as their classes initialise them (to train
            an MTP layer, ``benchmarks/targets/train_mtp.py``).
    Raises:
        DrafterError: the tensors do not fit the model's MTP layer (missing or unexpected names,
            wrong shapes), or the model has no full-attention layer to copy the kind from.
    """

    def __init__(self, model: nn.Module, tensors: dict[str, Tensor] | None):
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
        if tensors is not None:
            load_mtp_state(self, tensors, model)

    kernels = False  # the norms as Triton launches (the adapter's choice, set on bind)

    def bind(self, adapter: ModelAdapter) -> None:
        self.to(adapter.device, adapter.dtype).eval()
        self.text, self.lm_head = text_parts(adapter.model)
        self.kernels = adapter.triton_kernels
        self.attention = QwenAttention(self.layers[0].self_attn, self.text.rotary_emb, adapter.dtype, adapter.device,
                                       self.kernels)

    def features(self, hidden: Tensor) -> Tensor:
        return norm(self.text.norm, hidden, self.kernels)

    def pair(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """``fc([norm_e(e) ; norm_h(f)])``: ``[..., hidden]``."""
        return self.fc(torch.cat([norm(self.pre_fc_norm_embedding, embedding, self.kernels),
                                  norm(self.pre_fc_norm_hidden, feature, self.kernels)], -1))

    def attention_input(self, h: Tensor) -> Tensor:
        return norm(self.layers[0].input_layernorm, h, self.kernels)

    def run(self, h: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        return norm(self.norm, decoder_layer(self.layers[0], h, attend, self.kernels), self.kernels)

    def logits(self, feature: Tensor) -> Tensor:
        return self.lm_head(feature)


def mtp_drafter(model: nn.Module) -> MTPDrafter:
    """``drafter="mtp"``: the MTP layer of the checkpoint ``model`` was loaded from.

    Raises:
        DrafterError: the model names no checkpoint directory with ``mtp.*`` tensors, or they do
            not fit (see :class:`QwenMTPHead`).
    """
    directory = checkpoint_directory(model, text_parts(model)[0].config)
    return MTPDrafter(QwenMTPHead(model, mtp_tensors(directory)))
