"""How a verify kernel takes the fused delayed commit (FLA's launch style): the pending commit
stays a typed :class:`specla.records.LayerCommit` down to the launch, which binds its record's
fields to the kernel's parameters by keyword; without one they are ``None`` (no dummy pointers)
and the kernel's ``HAS_PENDING`` flag, set by :data:`with_pending`, compiles the commit out.
The standalone commit (:func:`flush`) is the same kernel launched with an empty chain.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..records import LayerCommit, R

with_pending = triton.heuristics({"HAS_PENDING": lambda args: args["path"] is not None})
"""Decorator (above ``@triton.jit``) of a kernel with a fused pending commit: ``HAS_PENDING`` is
whether the launch passed a ``path``."""


def pending_launch(pending: LayerCommit | None, fields: dict[str, str], width: str = "P",
                   length: str = "Tp") -> dict[str, Tensor | int | None]:
    """The keyword arguments of a kernel launch for its fused pending commit.

    Args:
        pending: the layer's pending commit, or ``None``.
        fields: kernel parameter -> record field (``{"pk": "k", "pdelta": "delta"}``); the first
            field's tensor is ``[B, Tp, ...]``.
        width, length: the kernel's parameter names of the path width ``P`` and the record length
            ``Tp``.
    Returns:
        each parameter of ``fields`` bound to its (contiguous) record field, ``path`` and
        ``path_len``, and the two sizes; without a pending commit, or with a path of width 0
        (which commits nothing, and a kernel would read one entry of it), the tensors are
        ``None`` and the sizes 1.
    """
    if pending is None or pending.path.shape[1] == 0:
        return dict.fromkeys([*fields, "path", "path_len"]) | {width: 1, length: 1}
    out = {param: getattr(pending.record, name).contiguous() for param, name in fields.items()}
    first = out[next(iter(fields))]
    return out | {"path": pending.path.contiguous(), "path_len": pending.path_len.contiguous(),
                  width: pending.path.shape[1], length: first.shape[1]}


def own_slots(state: Tensor, strides: tuple[str, ...], layers: tuple[str, ...]) -> dict[str, Tensor | int | None]:
    """The placement arguments of a serial kernel that also runs an engine's pool commit, for
    specla's own states: sequence ``b``'s state at slot ``b`` of ``state``, its pending records at
    row ``b``, path entries as node indices, one layer.

    Args:
        state: ``[B, ...]`` the committed states; its strides, slot dim first, bind the kernel's
            parameters ``strides`` (one per dim).
        strides: the kernel's state-stride parameters (``("sS_b", "sS_h", "sS_k", "sS_v")``).
        layers: the kernel's layer-stride parameters (the state's, then each record field's), all 0.
    Returns:
        keyword arguments: ``state_idx`` and ``rec_idx`` ``None``, ``path_step`` 0, ``layers`` 0
        and ``strides`` from ``state``.
    """
    return pool_slots(state.stride(), None, None, strides, layers)


def pool_slots(state_strides: tuple[int, ...], state_idx: Tensor | None, rec_idx: Tensor | None,
               strides: tuple[str, ...], layers: tuple[str, ...]) -> dict[str, Tensor | int | None]:
    """The placement arguments of a serial kernel's verify of one layer: sequence ``b``'s state
    at slot ``state_idx[b]`` of a pool of ``state_strides`` (slot dim first, in the kernel's
    order), its records at row ``rec_idx[b]`` (``None``: slot and row ``b``), path entries as node
    indices; ``strides`` and ``layers`` as :func:`own_slots`'s."""
    return dict(state_idx=state_idx, rec_idx=rec_idx, path_step=0, **dict.fromkeys(layers, 0),
                **dict(zip(strides, state_strides, strict=True)))


def layer_record(pending: LayerCommit, record_type: type[R]) -> R:
    """``pending.record``, checked to be a ``record_type``.

    Raises:
        ValueError: ``pending`` is not a :class:`LayerCommit` of a ``record_type``.
    """
    if not isinstance(pending, LayerCommit) or not isinstance(pending.record, record_type):
        raise ValueError(f"pending must be a LayerCommit of a {record_type.__name__}, got {type(pending).__name__}")
    return pending.record


def check_layer_commit(pending: LayerCommit, record_type: type, batch: int, shapes: dict[str, tuple[int, ...]],
                       float32: tuple[str, ...] = ()) -> None:
    """Check a verify or commit kernel's pending commit against the state it applies to.

    Args:
        pending: what the caller passed. record_type: the plugin's factor record class.
        batch: ``B``. shapes: record field -> its shape after ``[B, Tp]`` (``Tp`` read from the
            first field). float32: the fields that must be float32.
    Raises:
        ValueError: ``pending`` is not a :class:`LayerCommit` of ``record_type``, a field's shape
            or dtype differs, or the paths are not ``path [B, P]`` and ``path_len [B]`` int64
            (the message gives the expected layout).
    """
    name = record_type.__name__
    rec, path, plen = layer_record(pending, record_type), pending.path, pending.path_len
    Tp = getattr(rec, next(iter(shapes))).shape[1]
    fields_ok = all(getattr(rec, f).shape == (batch, Tp, *tail) for f, tail in shapes.items()) and \
        all(getattr(rec, f).dtype == torch.float32 for f in float32)
    paths_ok = path.dim() == 2 and path.shape[0] == batch and plen.shape == (batch,) and \
        path.dtype == torch.int64 and plen.dtype == torch.int64
    if not (fields_ok and paths_ok):
        layout = ", ".join(f"{f} [B, Tp, {', '.join(map(str, tail))}]" + (" f32" if f in float32 else "")
                           for f, tail in shapes.items())
        raise ValueError(f"pending must be a LayerCommit of a {name} ({layout}) with B = {batch}, path [B, P] "
                         "int64 and path_len [B] int64")


def flush(kernel, grid: tuple[int, int], state: Tensor, layout: str, commit: LayerCommit, **launch) -> Tensor:
    """Standalone closed-form commit, in place: ``commit`` applied to ``state`` by a serial verify
    kernel launched with an empty chain (``T = 0``), so the commit code is the very code that runs
    fused inside the verify kernels. No chain token is read or written, so ``state`` stands in for
    every chain pointer before the kernel's ``num_nodes`` (the commit's ``path_len``, unread
    at ``T = 0``).

    Args:
        kernel: a serial verify kernel decorated with :data:`with_pending`; grid: its launch grid.
        state: float32, contiguous, of the shape ``layout`` names (``"[B, HV, K, V]"``, used in
            the error message); updated in place and returned.
        commit: the layer's pending commit, already checked to fit ``state`` (the op's shape
            check); path_len ``0`` leaves a sequence's state bit-identical (it is not even written).
        launch: the kernel's remaining arguments (sizes, block sizes, the pending commit's
            keyword arguments from :func:`pending_launch`, ``num_warps``).
    Returns:
        ``state``.
    Raises:
        ValueError: ``state`` is not contiguous float32, or the tensors are on more than one
            device.
    """
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 {layout}, got {state.dtype}")
    if len({x.device for x in (state, *commit.tensors())}) != 1:
        raise ValueError("all tensors must be on one device")
    commit_alone(kernel, grid, state, commit.path_len, **launch)
    return state


def commit_alone(kernel, grid: tuple[int, ...], state: Tensor, path_len: Tensor, /, **launch) -> None:
    """Launch a serial verify kernel with an empty chain (``T = 0``), so that only its fused
    commit runs: ``state`` stands in for every chain pointer before the kernel's ``num_nodes``,
    which takes ``path_len`` (unread at ``T = 0``). :func:`flush` and the ops' serving-engine
    commits launch through it.

    Args:
        kernel: a serial verify kernel decorated with :data:`with_pending`; grid: its launch grid.
        state: the state (or pool) the commit writes.
        path_len: ``[B]`` accepted nodes per sequence (positional: ``launch`` names it again
            among the pending commit's arguments).
        launch: the kernel's remaining arguments, its pending commit's among them.
    """
    chain = kernel.arg_names.index("num_nodes")
    kernel[grid](*[state] * chain, path_len, T=0, **launch)
