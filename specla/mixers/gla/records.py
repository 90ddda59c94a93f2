"""The factor record of a GLA verify pass (the
``snapshot`` and ``replay`` baselines use :mod:`specla.baselines`' generic records).

Shapes: ``B`` sequences, ``T`` verified nodes (``N + 1`` with the root), ``H`` heads (key/value
heads already repeated to the query heads, as FLA's layer does for ``num_kv_heads``), ``K``/``V``
head dims, ``Dc = key_dim + (key_dim + value_dim) / kv_groups`` short-conv channels (the q, k, v
projections concatenated, before head repetition), ``C`` conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class GLAFactorRecord(Record):
    """SpecLA's factor record for GLA (docs/DESIGN.md section 5): all the closed-form commit needs.

    ``S_new = diag(exp(Gk_a)) S0 + sum_{j on path(a)} diag(exp(Gk_a - Gk_j)) k_j v_j^T``.
    """

    k: Tensor  # [B, T, H, K] float32 (float64 in float64 runs), keys after the feature map
    v: Tensor  # [B, T, H, V] float32
    Gk: Tensor  # [B, T, H, K] float32, per-channel log decay summed along each node's root path
    conv_x: Tensor | None  # [B, T, Dc] activation dtype, pre-conv projections (None: no short conv)
