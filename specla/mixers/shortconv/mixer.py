"""A gated short convolution (LFM2's ``Lfm2ShortConv``) as a sequence mixer
(:class:`specla.mixers.Mixer`): its state is the window of the last ``L - 1`` inputs, which under
a draft tree follows each node's root path (:func:`specla.ops.conv.tree_conv`)."""

from __future__ import annotations

import torch
from torch import Tensor

from specla.mixers import Mixer, TreePass
from specla.ops.conv import conv_window_after, conv_windows_per_node, tree_conv
from specla.records import LayerCommit, Record

from .records import ConvRecord


class ShortConvMixer(Mixer):
    """LFM2's gated short convolution (``Lfm2ShortConv``) under draft trees: ``B, C, x =
    in_proj(h)`` (in that order), ``y = C * conv(B * x)`` with a causal depthwise convolution of
    width ``L`` and no activation, then ``out_proj(y)``; the convolution reads each node's last
    ``L - 1`` inputs along its root path (:func:`specla.ops.conv.tree_conv`).

    State: the window ``[B, L - 1, D]`` of committed inputs in the activation dtype (fixed-size,
    like the conv windows of the recurrent mixers, and not in float32: no recurrence accumulates
    in it).

    Args:
        conv: the layer's ``Lfm2ShortConv`` module (``in_proj``, ``conv``, ``out_proj``).
        dtype, device: the window's.
    """

    recurrent = False
    baselines = frozenset({"snapshot", "replay"})  # replay: the record holds the inputs, as factor's does

    def __init__(self, conv: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        self.module, self.dtype, self.device = conv, dtype, device
        self.weight = conv.conv.weight.detach()[:, 0]  # [D, L]
        self.bias = conv.conv.bias.detach() if conv.conv.bias is not None else None
        self.L = self.weight.shape[1]
        self.empty_state(0, 0)

    def empty_state(self, B: int, capacity: int) -> None:
        self.conv = torch.zeros(B, self.L - 1, self.weight.shape[0], dtype=self.dtype, device=self.device)

    def empty_record(self, B: int, T: int) -> ConvRecord:
        return ConvRecord(torch.zeros(B, T, self.weight.shape[0], dtype=self.dtype, device=self.device))

    def state(self) -> list[Tensor]:
        return [self.conv]

    def state_names(self) -> list[str]:
        return ["conv window"]

    def set_state(self, tensors) -> None:
        self.conv = next(tensors)

    def verify(self, h: Tensor, tp: TreePass, pending: LayerCommit | None) -> tuple[Tensor, Record]:
        if pending is not None:  # the delayed commit of the previous step
            self.commit(pending, False)
        Bg, Cg, x = self.module.in_proj(h).chunk(3, dim=-1)
        bx = Bg * x
        anc = tp.conv_ancestors(self.L)
        y = Cg * tree_conv(bx, self.conv, self.weight, self.bias, anc, silu=False)
        return self.module.out_proj(y), ConvRecord(conv_x=bx)

    def node_states(self, record: ConvRecord, tp: TreePass) -> list[Tensor]:
        return [conv_windows_per_node(record.conv_x, self.conv, tp.conv_ancestors(self.L))]

    prefill_continues = True  # the convolution reads the window it holds

    def prefills_whole(self, kernels: bool) -> bool:
        return True

    def prefill(self, h: Tensor, tp: TreePass) -> Tensor:
        """Whole prompts from the window it holds (:meth:`specla.mixers.Mixer.prefill`): the
        convolution along each prompt (the same operator on the chain) and the window after each
        row's ``tp.counts`` inputs."""
        Bg, Cg, x = self.module.in_proj(h).chunk(3, dim=-1)
        bx = Bg * x
        y = Cg * tree_conv(bx, self.conv, self.weight, self.bias, tp.conv_ancestors(self.L), silu=False)
        self.conv = conv_window_after(bx, self.conv, tp.chain()[0], tp.counts)
        return self.module.out_proj(y)

    def commit(self, pending: LayerCommit, kernels: bool) -> None:
        self.conv = conv_window_after(pending.record.conv_x, self.conv, pending.path, pending.path_len)
