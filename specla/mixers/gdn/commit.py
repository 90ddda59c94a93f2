"""Standalone closed-form commit (``flush``): applies a pending accepted path to the recurrent
state from its factor records, without verifying anything (end of generation, a switch to plain
decoding, before reading the state), through :func:`specla.ops.pending.flush`: the serial verify
kernel launched with an empty chain.
"""

from __future__ import annotations

import triton
from torch import Tensor

from specla.ops.pending import flush, layer_record, own_slots
from specla.records import LayerCommit

from .records import GDNFactorRecord
from .verify import SLOT_PARAMS, TUNING, _check_pending, _pending_kwargs, _serial_verify_kernel


def flush_commit(state: Tensor, pending: LayerCommit) -> Tensor:
    """Closed-form commit, in place: ``S_new = exp(G_a) S0 + sum_{j on path(a)} exp(G_a - G_j)
    k_j Delta_j^T`` (docs/DESIGN.md section 4).

    Args:
        state: ``[B, HV, K, V]`` float32, contiguous; updated in place and returned.
        pending: the layer's pending commit as its mixer is handed it, a
            :class:`specla.records.LayerCommit` of a ``GDNFactorRecord`` (``k [B, T, H, K]``,
            ``delta [B, T, HV, V]`` float32, ``G [B, T, HV]`` float32; ``conv_x`` is not read)
            with ``path [B, P]`` int64 root-to-leaf node indices, ``-1`` padded, and ``path_len
            [B]`` int64 (``0`` leaves that sequence's state bit-identical: it is not even written).
    Returns:
        ``state``.
    Raises:
        ValueError: ``pending`` is not such a LayerCommit, or shapes, dtypes or devices disagree.
    """
    B, HV, K, V = state.shape
    H = layer_record(pending, GDNFactorRecord).k.shape[2]
    _check_pending(B, H, K, HV, V, pending)
    BV = min(triton.next_power_of_2(V), TUNING["serial"]["BV"])
    return flush(_serial_verify_kernel, (B * HV, triton.cdiv(V, BV)), state, "[B, HV, K, V]", pending,
                 scale=1.0, SV=0, H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
                 **_pending_kwargs(pending), **own_slots(state, **SLOT_PARAMS), num_warps=TUNING["serial"]["num_warps"])
