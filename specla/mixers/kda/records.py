"""Per-layer records of a KDA verify pass, one type per commit strategy."""

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


@dataclass(frozen=True)
class KDAReplayRecord(Record):
    """The ``replay`` strategy: the per-token inputs the commit runs again."""

    k: Tensor  # [B, T, H, K] state dtype, L2-normalised
    v: Tensor  # [B, T, H, V] state dtype
    g: Tensor  # [B, T, H, K] state dtype, per-channel log decay
    beta: Tensor  # [B, T, H] state dtype
    conv_x: Tensor  # [B, T, 3 H D] activation dtype, the conv inputs


@dataclass(frozen=True)
class KDASnapshotRecord(Record):
    """The snapshot strategy: the state and the conv window after every node."""

    states: Tensor  # [B, T, H, K, V] state dtype
    conv_windows: Tensor  # [B, T, C - 1, 3 H D] activation dtype
