"""Nemotron-H's own drafter: the MTP module its newer checkpoints ship (``mtp.layers.*`` tensors,
which transformers does not load; ``num_nextn_predict_layers`` and ``mtp_layers_block_type`` in the
config), as ``drafter="mtp"``.

The module is a short stack of Nemotron-H blocks (``mtp_layers_block_type``, e.g. attention then
MoE), each ``x + mixer(norm(x))`` as in the decoder. The first block also holds ``enorm``,
``hnorm`` and ``eh_proj``: its input is ``eh_proj([enorm(embed(x_{p+1})) ; hnorm(f_p)])`` with
``f_p`` the target's final-normed feature; the last block holds ``final_layernorm``, whose output
is the predicted feature and, through the target's LM head, the logits (the layout vLLM and SGLang
load). Nemotron-H's attention has no positional encoding. The drafter is the core's
:class:`specla.drafters.mtp.MTPDrafter` over :class:`NemotronHMTPHead`.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn

from specla.drafters.mtp import MTPDrafter, MTPHead, checkpoint_directory, load_mtp_state, mtp_tensors
from specla.errors import DrafterError
from specla.model.adapter import ModelAdapter

from .spec import attention_mixer


class NemotronHMTPHead(MTPHead):
    """Nemotron-H's MTP module, built from transformers' ``NemotronHBlock`` and
    ``NemotronHRMSNorm`` and loaded from the checkpoint's ``mtp.*`` tensors.

    Args:
        model: the target ``NemotronHForCausalLM`` (its config and classes are read).
        tensors: the ``mtp.*`` tensors without the prefix (``layers.{i}.*``; per-expert MoE
            weights as the checkpoints ship them, or stacked: :func:`specla.drafters.mtp.stack_experts`).
    Raises:
        DrafterError: the config asks for more than one MTP module, its block pattern has no or
            several attention blocks or a block of another kind (Mamba2), or the tensors do not fit (missing or
            unexpected names, wrong shapes).
    """

    def __init__(self, model: nn.Module, tensors: dict[str, Tensor]):
        super().__init__()
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

        cfg = copy.copy(model.config)
        kinds = list(cfg.mtp_layers_block_type or [])
        if getattr(cfg, "num_nextn_predict_layers", 1) > 1:
            raise DrafterError(f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: one MTP module is supported")
        if kinds.count("full_attention") != 1 or set(kinds) - {"full_attention", "mlp", "moe"}:
            raise DrafterError(f"mtp_layers_block_type {kinds}: an MTP module of exactly one attention block and "
                               "MLP / MoE blocks is supported")
        cfg.layers_block_type = kinds  # NemotronHBlock reads its kind from the config by index
        H, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.layers = nn.ModuleList([NemotronHBlock(cfg, i) for i in range(len(kinds))])
        first, last = self.layers[0], self.layers[-1]
        first.enorm, first.hnorm = NemotronHRMSNorm(H, eps=eps), NemotronHRMSNorm(H, eps=eps)
        first.eh_proj = nn.Linear(2 * H, H, bias=False)
        last.final_layernorm = NemotronHRMSNorm(H, eps=eps)
        self.attention_index = kinds.index("full_attention")
        load_mtp_state(self, tensors, model)

    def bind(self, adapter: ModelAdapter) -> None:
        self.to(adapter.device, adapter.dtype).eval()
        self.final_norm, self.lm_head = adapter.model.model.norm_f, adapter.model.lm_head
        # the attention mixer the model's own Nemotron-H attention layers run
        self.attention = attention_mixer(self.layers[self.attention_index].mixer, adapter.model, adapter.placement)

    def features(self, hidden: Tensor) -> Tensor:
        return self.final_norm(hidden)

    def pair(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """``eh_proj([enorm(e) ; hnorm(f)])``: ``[..., hidden]``."""
        first = self.layers[0]
        return first.eh_proj(torch.cat([first.enorm(embedding), first.hnorm(feature)], -1))

    def _blocks(self, x: Tensor, stop: int, attend: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Blocks ``0 .. stop - 1`` on the stream ``x``; the attention block mixes by ``attend``."""
        for i, block in enumerate(self.layers[:stop]):
            h = block.norm(x.to(block.norm.weight.dtype))
            x = x + (attend(h) if i == self.attention_index else block.mixer(h))
        return x

    def attention_input(self, h: Tensor) -> Tensor:
        block = self.layers[self.attention_index]
        x = self._blocks(h, self.attention_index)
        return block.norm(x.to(block.norm.weight.dtype))

    def run(self, h: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        return self.layers[-1].final_layernorm(self._blocks(h, len(self.layers), attend))

    def logits(self, feature: Tensor) -> Tensor:
        return self.lm_head(feature.to(self.lm_head.weight.dtype))


def mtp_drafter(model: nn.Module) -> MTPDrafter:
    """``drafter="mtp"`` for a ``NemotronHForCausalLM``: the MTP module of the checkpoint it was
    loaded from.

    Raises:
        DrafterError: not a Nemotron-H model, no checkpoint directory with ``mtp.*`` tensors, or
            tensors that do not fit (see :class:`NemotronHMTPHead`).
    """
    if model.config.model_type != "nemotron_h":
        raise DrafterError(f"drafter='mtp': of the mamba2_hybrid families only Nemotron-H checkpoints ship an MTP "
                           f"module, and this model is {model.config.model_type!r}")
    return MTPDrafter(NemotronHMTPHead(model, mtp_tensors(checkpoint_directory(model))))
