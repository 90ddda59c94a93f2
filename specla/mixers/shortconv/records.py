"""The record of a gated short convolution's verify pass (the ``snapshot`` baseline uses
:mod:`specla.baselines`' generic record)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class ConvRecord(Record):
    """A short convolution's factor and replay record: the nodes' convolution inputs, from which
    the commit takes the accepted path's into the window."""

    conv_x: Tensor  # [B, T, D] activation dtype, B * x before the convolution
