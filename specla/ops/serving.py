"""Argument checks and views shared by the entry points that run specla's verify and commit on a
serving engine's own data (``specla.mixers.<op>.serving``): the engine's state pool, its index
tensors, its packed token rows, and the factor records in engine-owned buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def token_rows(x: Tensor, *inner: int) -> Tensor:
    """``x [..., *inner]`` as ``[tokens, *inner]`` with dense inner dims, a view where the strides
    allow (an engine's per-token tensors are slices of one wider projection)."""
    y = x.reshape(-1, *inner)
    dense = y.stride(-1) == 1 and all(y.stride(i) == y.stride(i + 1) * y.shape[i + 1] for i in range(-len(inner), -1))
    return y if dense else y.contiguous()


def check_index(name: str, x: Tensor, N: int, device) -> None:
    """``x`` must be an int32 or int64 ``[N]`` on ``device`` (ValueError)."""
    if x.shape != (N,) or x.dtype not in (torch.int32, torch.int64) or x.device != device:
        raise ValueError(f"{name} must be int32 or int64 [{N}] on {device}, got {x.dtype} {list(x.shape)}")


def check_accept(accept_index: Tensor, N: int, device) -> None:
    """SGLang's ``accept_index`` must be an int32 or int64 ``[N, P]`` on ``device`` (ValueError)."""
    if accept_index.dim() != 2 or accept_index.shape[0] != N or \
            accept_index.dtype not in (torch.int32, torch.int64) or accept_index.device != device:
        raise ValueError(f"accept_index must be int32 or int64 [{N}, P] on {device}, got {accept_index.dtype} "
                         f"{list(accept_index.shape)}")


def check_records(records: NamedTuple, kind: type, tails: dict[str, tuple[int, ...]], device,
                  lead: tuple = ()) -> int:
    """Records must be a ``kind`` of float32 ``[*lead, R, D, *tails[field]]`` fields on
    ``device``, each layer's contiguous (the layer stride is free); returns ``D``.

    Raises:
        ValueError: naming the first field that differs, with the expected shape.
    """
    if not isinstance(records, kind):
        raise ValueError(f"records must be {kind.__name__}, got {type(records).__name__}")
    R, D = getattr(records, next(iter(tails))).shape[len(lead):len(lead) + 2]
    for name, tail in tails.items():
        x = getattr(records, name)
        shape = (*lead, R, D, *tail)
        if tuple(x.shape) != shape or x.dtype != torch.float32 or x.device != device or \
                not x[(0,) * len(lead)].is_contiguous():
            layer = "each layer's " if lead else ""
            raise ValueError(f"records.{name} must be float32 {list(shape)} on {device}, {layer}contiguous, got "
                             f"{x.dtype} {list(x.shape)} on {x.device}")
    return D


def check_pool(name: str, state: Tensor, tail: tuple[int, ...], note: str, layers: bool = False) -> tuple[int, ...]:
    """An engine's state pool must be float32 ``[slots, *tail]`` (``[layers, slots, *tail]``
    where ``layers``), any strides; returns its strides after the layer dim.

    Raises:
        ValueError: ``"{name} must be float32 [slots, *tail] {note}, got ..."``.
    """
    lead = "layers, " if layers else ""
    if state.dim() != 1 + len(tail) + layers or tuple(state.shape[-len(tail):]) != tail or \
            state.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 [{lead}slots, {', '.join(map(str, tail))}] {note}, "
                         f"got {state.dtype} {list(state.shape)}")
    return state.stride()[layers:]


def check_rows(D: int, cache_steps: int | None, max_steps: int, lead: tuple[int, ...], cu_seqlens: Tensor | None,
               slot_name: str, slots: Tensor, rows: Tensor, parents: Tensor | None,
               device) -> tuple[int, int, Tensor | None]:
    """The rows of a tree verify call on an engine's data: ``N`` rows (``lead[0]`` of ``[N, T,
    ...]`` tokens, or ``cu_seqlens [N + 1]`` packed), each of at most ``steps = cache_steps``
    (default ``D``, the records' steps) tokens, their slots (``slot_name``) and record rows
    (``intermediate_state_indices``) ``[N]``, and parents ``[N, >= steps]`` or ``None``.

    Returns:
        ``(N, steps, parents)``, ``parents`` with a unit node stride.
    Raises:
        ValueError: rows longer than ``steps``, ``steps`` above ``D`` or ``max_steps``, or an
        index tensor of another shape, dtype or device.
    """
    steps = D if cache_steps is None else cache_steps
    N = lead[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is None and lead[1] > steps:
        raise ValueError(f"rows of {lead[1]} tokens exceed the records' {steps} steps")
    if steps > D or steps > max_steps:
        raise ValueError(f"cache_steps must be at most the records' D = {D} and {max_steps}, got {steps}")
    check_index(slot_name, slots, N, device)
    check_index("intermediate_state_indices", rows, N, device)
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"cu_seqlens must be int32 or int64 [N + 1], got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    if parents is not None:
        if parents.dim() != 2 or parents.shape[0] != N or parents.shape[1] < steps or \
                parents.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"retrieve_parent_token must be int32 or int64 [{N}, >= {steps}], got "
                             f"{parents.dtype} {list(parents.shape)}")
        parents = parents if parents.stride(1) == 1 else parents.contiguous()
    return N, steps, parents


def check_commit(state: Tensor, D: int, slot_name: str, slots: Tensor, rows: Tensor, accept_index: Tensor,
                 accept_lens: Tensor, draft_token_num: int) -> None:
    """The rows of a path commit into an engine's pool ``state``: their slots (``slot_name``),
    record rows (``intermediate_state_indices``) and ``accept_lens`` ``[N]``, SGLang's
    ``accept_index [N, P]``, and a ``draft_token_num`` within the records' ``D`` steps
    (ValueError otherwise)."""
    N = slots.shape[0]
    check_index(slot_name, slots, N, state.device)
    check_index("intermediate_state_indices", rows, N, state.device)
    check_index("accept_lens", accept_lens, N, state.device)
    check_accept(accept_index, N, state.device)
    if draft_token_num > D:
        raise ValueError(f"draft_token_num {draft_token_num} exceeds the records' {D} steps")
