"""Standalone closed-form commit (``flush``): applies a pending accepted path to the recurrent
state from its factor records, without verifying anything (end of generation, a switch to plain
decoding, before reading the state). It launches the serial verify kernel with an empty chain, so
the commit code is the very code that runs fused inside the verify kernels.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from specla.records import LayerCommit

from .records import GLAFactorRecord
from .verify import _check_pending, _pending_kwargs, _serial_verify_kernel


def flush_commit(state: Tensor, k: Tensor, v: Tensor, Gk: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """Closed-form commit, in place: ``S_new = diag(exp(Gk_a)) S0 + sum_{j on path(a)}
    diag(exp(Gk_a - Gk_j)) k_j v_j^T`` (docs/DESIGN.md section 5).

    Args:
        state: ``[B, H, K, V]`` float32, contiguous; updated in place and returned.
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; Gk: ``[B, T, H, K]`` float32.
        path: ``[B, P]`` int64 root-to-leaf node indices, ``-1`` padded; path_len: ``[B]`` int64
            (``0`` leaves that sequence's state bit-identical: it is not even written).
    Returns:
        ``state``.
    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    B, H, K, V = state.shape
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 [B, H, K, V], got {state.dtype}")
    commit = LayerCommit(GLAFactorRecord(k=k, v=v, Gk=Gk, conv_x=None), path, path_len)
    _check_pending(B, H, K, V, commit)
    if len({x.device for x in (state, k, v, Gk, path, path_len)}) != 1:
        raise ValueError("all tensors must be on one device")
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)
    # T = 0: no chain token is read or written, so the state stands in for the chain's pointers
    _serial_verify_kernel[(B * H, triton.cdiv(V, BV))](
        state, state, state, state, state, state, state, path_len, scale=1.0, T=0, H=H, K=K, V=V, BK=BK, BV=BV,
        **_pending_kwargs(commit),
    )
    return state
