"""The factor record of a Mamba2 verify pass (the
``snapshot`` and ``replay`` baselines use :mod:`specla.baselines`' generic records).

Shapes: ``B`` sequences, ``T`` verified nodes (``N + 1`` with the root), ``H`` SSM heads, ``P``
head dim, ``G`` groups, ``N`` state size, ``Dc = H * P + 2 * G * N`` conv channels (the ``xBC``
slice of ``in_proj``), ``C`` conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class Mamba2FactorRecord(Record):
    """SpecLA's factor record for SSD (docs/DESIGN.md section 5): all the closed-form commit needs.

    ``S_new = exp(G_a) S0 + sum_{j on path(a)} exp(G_a - G_j) Bm_j u_j^T``.
    """

    Bm: Tensor  # [B, T, G, N] activation dtype, SSM input matrix after the conv
    u: Tensor  # [B, T, H, P] float32 (float64 in float64 runs), dt * x
    G: Tensor  # [B, T, H] float32, log decay dt * A summed along each node's root path
    conv_x: Tensor  # [B, T, Dc] activation dtype, pre-conv xBC projections
