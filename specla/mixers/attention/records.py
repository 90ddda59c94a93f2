"""The record of an attention verify pass.

Shapes: ``B`` sequences, ``T`` verified nodes with the root, ``HKV`` key/value heads, ``Dh`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specla.records import Record


@dataclass(frozen=True)
class KVRecord(Record):
    """An attention mixer's record: every node's key and value. The commit writes the accepted
    path's into the cache; the strategies (factor and the baselines) coincide for a KV cache."""

    k: Tensor  # [B, T, HKV, Dh] cache dtype, rotary embedding applied
    v: Tensor  # [B, T, HKV, Dh] cache dtype (``k`` itself for a mixer with ``shared_kv``)
