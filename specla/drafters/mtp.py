"""The model's own drafter: the multi-token-prediction (MTP) module a checkpoint ships beside its
decoder (``mtp.*`` tensors, which transformers does not load), as ``drafter="mtp"``.

An MTP module (DeepSeek-V3's, as Qwen3.5 / Qwen3-Next and Nemotron-H ship it, and as vLLM and
SGLang run it) reads the target's final-normed feature ``f_p`` and the embedding of the next token
``x_{p+1}``, mixes them into one stream (``W [norm_e(e) ; norm_h(f)]``), runs a few decoder
blocks of the model's own classes over the pairs so far (exactly one of them softmax attention,
causal over the pairs), and ends with a norm whose output ``f'`` is both the predicted feature and,
through the target's LM head, the next-token logits. Deeper draft levels feed ``f'`` back in.

That is the EAGLE drafter's shape (:class:`specla.drafters.eagle.EagleDrafter`: a cache of the
accepted pairs' keys and values that follows the accepted path, trees by the confidence-pruned
builder), so :class:`MTPDrafter` subclasses it and takes its layer from an :class:`MTPHead`, which
each plugin builds from its model's classes and the checkpoint's tensors.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import DrafterError
from ..interfaces import TargetAdapter
from ..ops.attention import draft_level_attention
from .eagle import EagleDrafter, attention_kernels, kernel_forms
from .pruning import take_rows


def mtp_tensors(directory: str | Path) -> dict[str, Tensor]:
    """Every ``mtp.*`` tensor of a checkpoint directory's safetensors files, prefix removed (also
    under ``language_model.``, where multimodal checkpoints keep the text model).

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
                name = key.removeprefix("language_model.")
                if name.startswith("mtp."):
                    out[name[4:]] = st.get_tensor(key)
    if not out:
        raise DrafterError(f"drafter='mtp' reads the checkpoint's mtp.* tensors, and {d} holds none"
                           + ("" if files else " (no safetensors files there)")
                           + ": load the model from a checkpoint directory that ships its MTP layer")
    return out


def checkpoint_directory(model: nn.Module, config=None) -> Path:
    """The checkpoint directory ``model`` was loaded from (``_name_or_path`` of ``config``, its
    text config, or of ``model.config``): a local directory, or a Hugging Face Hub id whose
    snapshot is in the local cache (looked up without network access).

    Raises:
        DrafterError: the model names neither.
    """
    source = getattr(config, "_name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if source and Path(source).is_dir():
        return Path(source)
    if source:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, local_files_only=True))
        except Exception:  # not an id, or not cached: refused below  # noqa: BLE001
            pass
    raise DrafterError("drafter='mtp' reads the MTP layer from the checkpoint directory the model was loaded "
                       f"from, and this model names none that is here ({source!r}): load it with "
                       "from_pretrained(DIR) or from a Hub id whose snapshot is cached, or pass DIR to specla")


def stack_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The per-expert MoE weights checkpoints ship (``...experts.{e}.gate_proj.weight``,
    ``up_proj``, ``down_proj``) as transformers' stacked expert parameters, as its own loading
    does for the decoder: ``...experts.down_proj [E, out, in]``, and ``...experts.gate_up_proj``
    (each expert's gate rows, then its up rows) where there is a gate projection, else
    ``...experts.up_proj``; every other name passes through.

    Raises:
        DrafterError: expert indices that are not ``0..E-1``, experts of one projection with
            different shapes, or a gate projection without an up projection.
    """
    out: dict[str, Tensor] = {}
    stacks: dict[tuple[str, str], dict[int, Tensor]] = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault((m[1], m[3]), {})[int(m[2])] = t

    def stacked(prefix: str, proj: str) -> Tensor:
        experts = stacks[(prefix, proj)]
        if sorted(experts) != list(range(len(experts))):
            raise DrafterError(f"the checkpoint's mtp.{prefix}.*.{proj} experts are not numbered 0..{len(experts) - 1}")
        shapes = sorted({tuple(t.shape) for t in experts.values()})
        if len(shapes) != 1:
            raise DrafterError(f"the checkpoint's mtp.{prefix}.*.{proj} experts differ in shape: {shapes}")
        return torch.stack([experts[e] for e in range(len(experts))])

    for prefix in sorted({p for p, _ in stacks}):
        projs = {proj for p, proj in stacks if p == prefix}
        if "down_proj" in projs:
            out[f"{prefix}.down_proj"] = stacked(prefix, "down_proj")
        if "gate_proj" in projs:
            if "up_proj" not in projs:
                raise DrafterError(f"the checkpoint's mtp.{prefix} experts have gate_proj but no up_proj")
            gate, up = stacked(prefix, "gate_proj"), stacked(prefix, "up_proj")
            if gate.shape != up.shape:
                raise DrafterError(f"the checkpoint's mtp.{prefix} experts: gate_proj {list(gate.shape[1:])} and "
                                   f"up_proj {list(up.shape[1:])} differ in shape")
            out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], 1)
        elif "up_proj" in projs:
            out[f"{prefix}.up_proj"] = stacked(prefix, "up_proj")
    return out


def load_mtp_state(module: nn.Module, tensors: dict[str, Tensor], model: nn.Module) -> None:
    """``module.load_state_dict(stack_experts(tensors))`` (strict: every weight of the MTP module
    must come from the checkpoint, none left as initialised).

    Raises:
        DrafterError: missing or unexpected names, or wrong shapes, naming ``model``'s class
            (and :func:`stack_experts`'s errors).
    """
    try:
        module.load_state_dict(stack_experts(tensors))
    except RuntimeError as err:
        raise DrafterError(f"the checkpoint's mtp.* tensors do not fit {type(model).__name__}'s MTP layer: "
                           f"{err}") from err


class MTPHead(nn.Module, ABC):
    """A checkpoint's MTP module, built by a plugin from its model's own classes (see the module
    docstring). :meth:`bind` gives it the target's placement and sets :attr:`attention`.

    Attributes:
        attention: the module's attention layer as a :class:`specla.mixers.AttentionMixer`
            (``project(h, positions) -> (q, k, v, gate)``, ``output(o, gate)``, ``HKV``, ``Dh``),
            set by :meth:`bind`.
    """

    attention = None

    @abstractmethod
    def bind(self, adapter: TargetAdapter) -> None:
        """Move to the adapter's device and dtype (eval mode) and build :attr:`attention`; the
        target's final norm and LM head are taken from the adapter's model."""

    @abstractmethod
    def features(self, hidden: Tensor) -> Tensor:
        """The MTP module's input feature of target last-layer features ``[..., hidden]`` (the
        target's final norm)."""

    @abstractmethod
    def pair(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """The stream of pairs (feature, next-token embedding), both ``[..., hidden]``:
        ``W [norm_e(embedding) ; norm_h(feature)]``."""

    @abstractmethod
    def attention_input(self, h: Tensor) -> Tensor:
        """The attention layer's input ``[B, T, hidden]`` for pair streams ``h`` (the blocks
        before it and its pre-norm): what the cached keys and values are projected from."""

    @abstractmethod
    def run(self, h: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        """Every block on the pair stream ``h [B, M, hidden]``, the attention layer's mixing
        done by ``attend(normed input) -> output``, then the final norm: the predicted feature."""

    @abstractmethod
    def logits(self, feature: Tensor) -> Tensor:
        """Next-token logits ``[..., vocab]`` of predicted features (the target's LM head)."""


class MTPDrafter(EagleDrafter):
    """Draft chains and trees from a checkpoint's MTP module (see the module docstring).

    State as :class:`EagleDrafter`'s, with the MTP attention's key/value heads in the cache. The
    module's blocks run through the model's own modules; the level's attention over the cache
    and the tree ancestors, the top-k, the tree bookkeeping and the cache update take EAGLE's
    Triton forms where the target runs its kernels (grouped key/value heads included).

    Args:
        head: the plugin's :class:`MTPHead`.
    """

    name = "mtp"

    def bind(self, adapter: TargetAdapter) -> None:
        self.adapter = adapter
        self.head.bind(adapter)
        self.kernels = kernel_forms(adapter)

    def _cache_heads(self) -> tuple[int, int]:
        return self.head.attention.HKV, self.head.attention.Dh

    def _features(self, hidden: Tensor) -> Tensor:
        return self.head.features(hidden)

    def _pair_kv(self, feats: Tensor, tokens: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
        h = self.head.pair(feats, self.adapter.embed(tokens))
        positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        _, k, v, _ = self.head.attention.project(self.head.attention_input(h), positions)
        return k, v

    def _logits(self, feature: Tensor) -> Tensor:
        return self.head.logits(feature)

    def _level(self, state: tuple[Tensor, Tensor, Tensor], slot: Tensor | None,
               tokens: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        """One draft level, in :meth:`EagleDrafter._level`'s layout: ``state`` holds the
        previous level's ``P`` predicted features ``[B, P, hidden]`` and the keys and values of
        their ``A`` ancestors and themselves ``[B, P, A, HKV, Dh]``; ``slot [B, M]``: the row each
        new node hangs from (``None``: row ``m``). Nodes sit at position ``cache_len + A`` (the
        pair of a feature at position ``p`` is at ``p``)."""
        feats, anc_k, anc_v = state
        B, M = tokens.shape
        positions = (self.cache_len + anc_k.shape[2])[:, None].expand(B, M)
        attn, kv = self.head.attention, []
        level = attention_kernels.draft_level_attention if self.kernels else draft_level_attention

        def attend(n: Tensor) -> Tensor:  # over the cache, the ancestors and the node itself
            q, k, v, gate = attn.project(n, positions)
            kw = dict(out_dtype=n.dtype) if self.kernels else {}
            o, keys, values = level(q, k, v, self.cache_k, self.cache_v, self.cache_len, anc_k, anc_v, slot, **kw)
            kv.extend([keys, values])
            return attn.output(o.to(n.dtype), gate)

        parents = feats if slot is None else take_rows(feats, slot)
        new = self.head.run(self.head.pair(parents, self.adapter.embed(tokens)), attend)
        return (new, *kv), new
