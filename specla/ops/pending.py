"""How a verify kernel takes the fused delayed commit (FLA's launch style): the pending commit
stays a typed :class:`specla.records.LayerCommit` down to the launch, which binds its record's
fields to the kernel's parameters by keyword; without one they are ``None`` (no dummy pointers)
and the kernel's ``HAS_PENDING`` flag, set by :data:`with_pending`, compiles the commit out.
"""

from __future__ import annotations

import triton
from torch import Tensor

from ..records import LayerCommit

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
        ``path_len``, and the two sizes; without a pending commit the tensors are ``None`` and
        the sizes 1.
    """
    if pending is None:
        return dict.fromkeys([*fields, "path", "path_len"]) | {width: 1, length: 1}
    out = {param: getattr(pending.record, name).contiguous() for param, name in fields.items()}
    first = out[next(iter(fields))]
    return out | {"path": pending.path.contiguous(), "path_len": pending.path_len.contiguous(),
                  width: pending.path.shape[1], length: first.shape[1]}
