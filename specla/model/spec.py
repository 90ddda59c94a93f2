"""What a plugin returns to describe its model to :class:`specla.model.adapter.ModelAdapter`:
where the run happens (:class:`Placement`, given to the plugin's builder) and the model's parts in
the order a pass calls them (:class:`ModelSpec`, returned by it).

Shapes: ``B`` sequences, ``T`` rows of a pass, ``hidden`` the model width, ``vocab`` its
vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..ops import kernels
from ..ops.norm import rms_norm

if TYPE_CHECKING:
    from ..mixers.base import Mixer

norm_kernels = kernels("specla.ops.norm_triton")


@dataclass(frozen=True)
class Placement:
    """Where and how a run computes, decided by the adapter before the plugin builds its model.

    Attributes:
        device: the run's device (``cuda`` with its index).
        dtype: the activation dtype (the model's weights are in it: the adapter hands the builder
            a converted copy where the caller's model is elsewhere).
        state_dtype: the recurrent states' dtype: float32, float64 in float64 runs.
        triton_kernels: the plugin's Triton kernels may run (``SpecConfig.engine.kernels`` ``triton``, or
            ``auto`` on a CUDA device); a pass runs them only with float32 states, ``factor``
            records and no autograd.
        differentiable: the weights stay attached to the caller's parameters (target training
            through :meth:`ModelAdapter.score`); the model is then never copied.
        own_copy: the model the builder gets is the adapter's own converted copy, which the
            builder may change (the caller's model is never modified).
    """

    device: torch.device
    dtype: torch.dtype
    state_dtype: torch.dtype
    triton_kernels: bool
    differentiable: bool = False
    own_copy: bool = False

    def act(self, p: Tensor | None) -> Tensor | None:
        """A weight on the run's device in the activation dtype (``None`` stays ``None``): the
        parameter itself (detached unless :attr:`differentiable`) where it is already so."""
        if p is None:
            return None
        return (p if self.differentiable else p.detach()).to(self.device, self.dtype)

    def state(self, p: Tensor) -> Tensor:
        """A parameter of a recurrence (decay, bias) on the run's device in :attr:`state_dtype`,
        detached unless :attr:`differentiable`."""
        return (p if self.differentiable else p.detach()).to(self.device, self.state_dtype)


def rms_head(placement: Placement, norm: Tensor, eps: float, head: Tensor) -> Callable[[Tensor], Tensor]:
    """``logits(hidden) = rms_norm(hidden, norm, eps) @ head.T``: a final RMSNorm (``norm
    [hidden]``) and LM head (``head [vocab, hidden]``), both in the activation dtype. Where the
    plugin's kernels may run and no gradient is taken the norm is one Triton launch
    (:func:`specla.ops.norm_triton.rms_norm`, same formula and roundings): a drafter scores every
    draft level with it inside a recorded step."""
    triton = placement.triton_kernels

    def logits(hidden: Tensor) -> Tensor:
        if triton and not (torch.is_grad_enabled() and hidden.requires_grad):
            return norm_kernels.rms_norm(hidden, norm, eps) @ head.T
        return rms_norm(hidden, norm, eps) @ head.T

    return logits


@dataclass(frozen=True)
class ModelSpec:
    """A model as the adapter runs it: embeddings, a stack of blocks that call sequence mixers,
    and the LM head. Every callable refers to values (weights, the model's modules, flags), never
    to the adapter: a dropped decoder then frees everything by reference counting.

    Attributes:
        model: the model whose modules the callables run (the adapter's copy where it made one;
            MTP drafters reuse its modules).
        embed_weight: ``[vocab, hidden]`` input embeddings, activation dtype.
        logits: ``logits(hidden [..., hidden]) -> [..., vocab]``: final norm and LM head (and a
            logit multiplier); :func:`rms_head` builds the plain form.
        mixers: every layer's sequence mixers in the order the blocks call them.
        block: ``block(li, x, mix, kernels) -> x``: layer ``li`` on the residual stream ``x [B,
            T, hidden]``, with its norms and position-wise modules, calling ``mix(h)`` (``h [B, T,
            hidden]`` the mixer's input; it returns the mixer's output) once per mixer of the
            layer in :attr:`mixers` order. ``kernels``: the pass runs the plugin's Triton kernels
            (fused position-wise forms may run too). The stream may be wider than the activations
            (``residual_in_fp32``); the adapter returns features in the activation dtype.
        num_layers: the blocks.
        eos_token_ids: the model's end-of-sequence ids (:func:`specla.hf.eos_token_ids`).
        embed_scale: the factor input embeddings are multiplied by (Falcon-H1's and Granite's
            ``embedding_multiplier``).
        graph_problem: why the passes cannot be recorded in a CUDA graph although the plugin
            declares ``cuda_graphs`` (MoE experts that read the host), or ``None``.
        score_sequences: :meth:`ModelAdapter.score` runs each layer over whole sequences through
            every mixer's ``sequence(h, chunk)`` (teacher-forced from an empty state,
            differentiable) rather than as chunked chains.
    """

    model: torch.nn.Module
    embed_weight: Tensor
    logits: Callable[[Tensor], Tensor]
    mixers: tuple[Mixer, ...]
    block: Callable[[int, Tensor, Callable[[Tensor], Tensor], bool], Tensor]
    num_layers: int
    eos_token_ids: tuple[int, ...] = ()
    embed_scale: float = 1.0
    graph_problem: str | None = None
    score_sequences: bool = False
