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

from .records import Mamba2FactorRecord
from .verify import SLOT_PARAMS, _check_pending, _pending_kwargs, _serial_verify_kernel, own_rows


def flush_commit(state: Tensor, pending: LayerCommit) -> Tensor:
    """Closed-form commit, in place: ``S_new = exp(G_a) S0 + sum_{j on path(a)} exp(G_a - G_j)
    Bm_j u_j^T`` (docs/DESIGN.md sections 4-5).

    Args:
        state: ``[B, H, N, P]`` float32, contiguous; updated in place and returned.
        pending: the layer's pending commit as its mixer is handed it, a
            :class:`specla.records.LayerCommit` of a ``Mamba2FactorRecord`` (``Bm [B, T, NG, N]``,
            ``u [B, T, H, P]`` float32, ``G [B, T, H]`` float32; ``conv_x`` is not read) with
            ``path [B, L]`` int64 root-to-leaf node indices, ``-1`` padded, and ``path_len [B]``
            int64 (``0`` leaves that sequence's state bit-identical: it is not even written).
    Returns:
        ``state``.
    Raises:
        ValueError: ``pending`` is not such a LayerCommit, or shapes, dtypes or devices disagree.
    """
    B, H, N, P = state.shape
    Bm = layer_record(pending, Mamba2FactorRecord).Bm
    if Bm.dim() != 4 or H % Bm.shape[2]:
        raise ValueError(f"Bm must be [B, T, NG, N] with H % NG == 0, got {list(Bm.shape)}")
    NG = Bm.shape[2]
    _check_pending(B, H, NG, N, P, pending)
    BP = min(triton.next_power_of_2(P), 64)
    return flush(_serial_verify_kernel, (B * H, triton.cdiv(P, BP)), state, "[B, H, N, P]", pending,
                 H=H, NG=NG, N=N, P=P, BN=triton.next_power_of_2(N), BP=BP, D_HDIM=False, **_pending_kwargs(pending),
                 **own_slots(state, **SLOT_PARAMS), **own_rows(H, P, NG, N, 0))
