"""CUDA-graph plumbing: recording work into a graph (with Python's cyclic garbage collector held
off), and the static buffers a recorded step reads and replaces (:func:`static_like`, filled by
:func:`copy_into`; docs/architecture.md, "CUDA graphs")."""

from __future__ import annotations

import contextlib
import gc
import math
import threading

import torch
from torch import Tensor


def record_graph(fn, device: torch.device | str, pool=None) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (Triton compiles, cuBLAS picks its workspaces, caches
    fill), then recorded into a new CUDA graph (in ``pool`` when given). The warm-up's effects on
    ``fn``'s buffers are the caller's to undo.

    Args:
        fn: the work to record, with no host reads of device values. device: a CUDA device.
        pool: a graph memory pool (``torch.cuda.graph_pool_handle()``) or ``None`` (private).
    Returns:
        the recorded graph (``replay()`` runs ``fn``'s kernels again).
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with _no_cyclic_gc(), torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


_gc_lock = threading.Lock()
_gc_holders = 0  # records in progress that hold the cyclic garbage collector off
_gc_was_enabled = False


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cyclic garbage collector off while a graph is recorded. An automatic collection
    during a capture may free an older decoder's graph that sat in a reference cycle; its
    ``CUDAGraph.reset`` is a CUDA call a capture forbids, which invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``). Automatic collections resume after the capture (the
    collector is switched back on if it was on when the first of overlapping records began);
    torch no longer collects before a capture (``torch.compiler.config.force_cudagraph_gc``)."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def whole_rows(t: Tensor) -> tuple[int, Tensor] | None:
    """``(c0, rows)`` when ``t`` (``[..., D]``, unit last stride, not contiguous) is columns ``c0
    .. c0 + D`` of dense rows of ``t.stride(-2)`` elements (a slice of a fused projection's
    output): ``rows`` those whole rows as a contiguous view of the same storage; else ``None``."""
    if t.dim() < 2 or t.stride(-1) != 1 or t.is_contiguous() or t.numel() == 0:
        return None
    width, D = t.stride(-2), t.shape[-1]
    if width < D:  # overlapping or broadcast rows (stride 0): not a slice of whole rows
        return None
    wide = (*t.shape[:-1], width)
    dense = torch.empty(wide, device="meta").stride()
    c0 = t.storage_offset() % width
    start = t.storage_offset() - c0
    if c0 + D > width or any(st != ds for n, st, ds in zip(t.shape[:-1], t.stride()[:-1], dense[:-1]) if n > 1):
        return None
    if start + math.prod(wide) > t.untyped_storage().nbytes() // t.element_size():
        return None
    return c0, t.as_strided(wide, dense, start)


def static_like(t: Tensor) -> Tensor:
    """A new buffer holding ``t``'s values with ``t``'s layout where :func:`copy_into` can copy
    it densely: a column slice of whole rows (:func:`whole_rows`) becomes the same columns of a new
    buffer of whole rows (the other columns are scratch), anything else a clone."""
    r = whole_rows(t)
    if r is None:
        return t.clone()
    c0, rows = r
    return rows.clone()[..., c0 : c0 + t.shape[-1]]


def copy_into(static: list[Tensor], new: list[Tensor]) -> None:
    """``static[i].copy_(new[i])`` for every ``new[i]`` that is not ``static[i]`` itself, with one
    multi-tensor copy per dtype for the pairs of equal dense layout (the pending commit's records
    alone are about 100 tensors per step; one copy kernel each would be 100 graph nodes), and a
    copy each for the rest. A pair of column slices of whole rows at the same columns (a fused
    projection's slice and its :func:`static_like` buffer) joins the multi-tensor copy as whole
    rows: ``static``'s other columns in those rows are overwritten, so they must be scratch. A
    pair that is dense but for the strides of size-1 dims (one row of one token) joins it flat."""
    groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for dst, src in zip(static, new):
        if src is dst:
            continue
        alike = dst.dtype == src.dtype and dst.shape == src.shape
        same = alike and dst.stride() == src.stride()
        if alike and not same and dst.is_contiguous() and src.is_contiguous():
            # dense alike but for the strides of size-1 dims (a one-row slice of a projection at batch
            # 1, one token): flat views share one layout (the multi-tensor copy compares strides)
            dst, src, same = dst.view(-1), src.view(-1), True
        elif same and not dst.is_contiguous():  # equal strides: whole rows of one width when both widen
            rd, rs = whole_rows(dst), whole_rows(src)
            if rd is not None and rs is not None and rd[0] == rs[0]:
                dst, src = rd[1], rs[1]
        if same:
            pair = groups.setdefault(dst.dtype, ([], []))
            pair[0].append(dst)
            pair[1].append(src)
        else:
            dst.copy_(src)
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)
