"""The factor record of a GDN verify pass (the
``snapshot`` and ``replay`` baselines use :mod:`specla.baselines`' generic records).

Shapes: ``B`` sequences, ``T`` verified nodes (``N + 1`` with the root), ``H`` key heads, ``HV``
value heads, ``K``/``V`` head dims, ``Dc = 2 * H * K + HV * V`` short-conv channels (q, k, v
projections concatenated), ``C`` conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class GDNFactorRecord(Record):
    """SpecLA's factor record (docs/DESIGN.md section 4): all that the closed-form commit needs.

    ``S_new = exp(G_a) S0 + sum_{j on path(a)} exp(G_a - G_j) k_j Delta_j^T``.
    """

    k: Tensor  # [B, T, H, K] float32 (float64 in float64 runs), L2-normalised keys
    delta: Tensor  # [B, T, HV, V] float32, the serial delta of each node on its own root path
    G: Tensor  # [B, T, HV] float32, log decay summed along each node's root path
    conv_x: Tensor | None  # [B, T, Dc] activation dtype, pre-conv projections (None: no short conv)
