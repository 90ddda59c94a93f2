"""The factor record of a KDA verify pass (the
``snapshot`` and ``replay`` baselines use :mod:`specla.baselines`' generic records)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class KDAFactorRecord(Record):
    """The ``factor`` strategy: what the closed-form commit needs per node
    (:func:`specla.mixers.kda.reference.kda_commit_factor`)."""

    k: Tensor  # [B, T, H, K] state dtype, L2-normalised
    delta: Tensor  # [B, T, H, V] state dtype, the delta rule's write on the node's root path
    Gk: Tensor  # [B, T, H, K] state dtype, per-channel log decay summed along the root path
    conv_x: Tensor  # [B, T, 3 H D] activation dtype, the conv inputs
