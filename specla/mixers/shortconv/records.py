"""Per-layer records of a gated short convolution's verify pass, one type per commit strategy."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class ConvRecord(Record):
    """A short convolution's factor and replay record: the nodes' convolution inputs, from which
    the commit takes the accepted path's into the window."""

    conv_x: Tensor  # [B, T, D] activation dtype, B * x before the convolution


@dataclass(frozen=True)
class ConvSnapshotRecord(Record):
    """The snapshot strategy's record: the window after each node's root path."""

    conv_windows: Tensor  # [B, T, L - 1, D] activation dtype
