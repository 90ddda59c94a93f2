"""Standalone closed-form commit (``flush``): applies a pending accepted path to the recurrent
state from its factor records, without verifying anything (end of generation, a switch to plain
decoding, before reading the state), through :func:`specla.ops.pending.flush`: the serial verify
kernel launched with an empty chain.
"""

from __future__ import annotations

import triton
from torch import Tensor

from specla.ops.pending import flush, own_slots
from specla.records import LayerCommit

from .verify import SLOT_PARAMS, TUNING, _check_pending, _pending_kwargs, _serial_verify_kernel, own_rows


def flush_commit(state: Tensor, pending: LayerCommit) -> Tensor:
    """Closed-form commit, in place: ``S_new = diag(exp(Gk_a)) S0 + sum_{j on path(a)}
    diag(exp(Gk_a - Gk_j)) k_j delta_j^T`` (:func:`specla.mixers.kda.reference.kda_commit_factor`).

    Args:
        state: ``[B, H, K, V]`` float32, contiguous; updated in place and returned.
        pending: the layer's pending commit as its mixer is handed it, a
            :class:`specla.records.LayerCommit` of a ``KDAFactorRecord`` (``k [B, T, H, K]``,
            ``delta [B, T, H, V]`` float32, ``Gk [B, T, H, K]`` float32; ``conv_x`` is not read)
            with ``path [B, P]`` int64 root-to-leaf node indices, ``-1`` padded, and ``path_len
            [B]`` int64 (``0`` leaves that sequence's state bit-identical: it is not even written).
    Returns:
        ``state``.
    Raises:
        ValueError: ``pending`` is not such a LayerCommit, or shapes, dtypes or devices disagree.
    """
    B, H, K, V = state.shape
    _check_pending(B, H, K, V, pending)
    BV = min(triton.next_power_of_2(V), TUNING["serial"]["BV"])
    return flush(_serial_verify_kernel, (B * H, triton.cdiv(V, BV)), state, "[B, H, K, V]", pending,
                 H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, **_pending_kwargs(pending),
                 **own_slots(state, **SLOT_PARAMS), **own_rows(H, K, V, 0), num_warps=TUNING["serial"]["num_warps"])
