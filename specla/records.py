"""Factor records and pending commits (docs/DESIGN.md section 3).

A verify pass leaves, per layer, a record of exactly what commit needs. With the ``factor``
strategy this is SpecLA's compact per-token factor record, one type per op; the ``snapshot`` and
``replay`` baselines use the generic records of :mod:`specla.baselines`, so the three strategies
can be compared behind one interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

R = TypeVar("R", bound="Record")


@dataclass(frozen=True)
class Record:
    """Base of every per-layer record: a frozen dataclass whose fields are tensors with the batch
    dimension ``B`` first, or tuples of them (a field may be ``None`` when a layer has no such
    input, e.g. no short convolution). Subclasses document each field's shape and dtype."""

    def select(self: R, index: Tensor) -> R:
        """Keep the sequences ``index`` (``[B']`` int64) of every field, in that order."""
        return replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    def tensors(self) -> list[Tensor]:
        """The tensor fields, in field order, a tuple's tensors in its order (``None`` fields left
        out)."""
        values = (getattr(self, f.name) for f in fields(self))
        return [x for v in values for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, Tensor)]

    def rebind(self: R, tensors: Iterator[Tensor]) -> R:
        """The record with its tensor fields bound to the next tensors of ``tensors``, in the
        order of :meth:`tensors` (``None`` fields stay ``None``)."""
        def take(v):
            return next(tensors) if isinstance(v, Tensor) else v

        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: tuple(map(take, v)) if isinstance(v, tuple) else take(v) for k, v in values.items()})

    def nbytes_per_sequence(self) -> int:
        """Bytes this record holds per sequence (all fields, a tensor held by two fields once;
        used for memory reports)."""
        held = {id(x): x for x in self.tensors() if x.numel()}
        return sum(x.numel() * x.element_size() // x.shape[0] for x in held.values())


def _take(x, index: Tensor):
    if isinstance(x, tuple):
        return tuple(_take(t, index) for t in x)
    return x.index_select(0, index.to(x.device)) if isinstance(x, Tensor) else x


@dataclass(frozen=True)
class Acceptance:
    """The outcome of accepting one verified step, per sequence.

    Attributes:
        path: ``[B, D + 1]`` int64 accepted nodes in root-explicit indexing (node 0 is the root,
            draft node ``i`` is ``i + 1``); ``path[b, 0] == 0``, then the accepted draft nodes in
            root-to-leaf order, padded with ``-1``.
        num_accepted: ``[B]`` int64 accepted draft tokens, ``0..D``.
        bonus: ``[B]`` int64, the target's token at the end of the accepted path (it becomes the
            next root).
        tokens: ``[B, D]`` int64 accepted draft tokens, padded with ``-1``.
    """

    path: Tensor
    num_accepted: Tensor
    bonus: Tensor
    tokens: Tensor

    @property
    def path_len(self) -> Tensor:
        """``[B]`` int64 tokens that reach the state on commit: the root plus the accepted drafts."""
        return self.num_accepted + 1

    def select(self, index: Tensor) -> "Acceptance":
        """Keep the sequences ``index`` (``[B']`` int64)."""
        return Acceptance(*(_take(x, index) for x in (self.path, self.num_accepted, self.bonus, self.tokens)))


class LayerCommit(NamedTuple):
    """One layer's part of a :class:`PendingCommit`, as its mixer and the mixer's kernels take it
    (a verify kernel binds the record's fields to its parameters, :mod:`specla.ops.pending`): the
    layer's record and the commit's accepted paths."""

    record: Record
    path: Tensor  # [B, P] int64
    path_len: Tensor  # [B] int64

    def tensors(self) -> list[Tensor]:
        """Every tensor of the record and the paths (for device checks)."""
        return [*self.record.tensors(), self.path, self.path_len]


@dataclass(frozen=True)
class PendingCommit:
    """An accepted path not yet applied to the recurrent state (delayed commit, ``factor`` only),
    built once per step (:meth:`from_records`) and handed whole to the next verify.

    Attributes:
        path: ``[B, P]`` int64 node indices of the accepted path (indexing of the verified tree),
            root-to-leaf, padded with ``-1``.
        path_len: ``[B]`` int64 nodes to commit per sequence; ``0`` leaves that sequence's state
            bit-identical.
        layers: one :class:`LayerCommit` per mixer, in the model's mixer order: ``layers[i]`` is
            what mixer ``i`` and its kernels take (its record from the verify pass that produced
            the path, with ``path`` and ``path_len`` themselves).
    """

    path: Tensor
    path_len: Tensor
    layers: tuple[LayerCommit, ...]

    @classmethod
    def from_records(cls, records: Iterable[Record], path: Tensor, path_len: Tensor) -> "PendingCommit":
        """The commit of ``path`` / ``path_len`` with one record per mixer, in mixer order."""
        return cls(path, path_len, tuple(LayerCommit(r, path, path_len) for r in records))

    @property
    def records(self) -> tuple[Record, ...]:
        """Each layer's record, in mixer order."""
        return tuple(layer.record for layer in self.layers)

    def tensors(self) -> list[Tensor]:
        """Every tensor the commit holds, in a fixed order: each layer's record tensors
        (:meth:`Record.tensors`) layer by layer, then ``path`` and ``path_len``."""
        return [t for r in self.records for t in r.tensors()] + [self.path, self.path_len]

    def rebind(self, tensors: Iterator[Tensor]) -> "PendingCommit":
        """The same commit on the next tensors of ``tensors``, in the order (and the shapes) of
        :meth:`tensors`; ``tensors`` is left at the first tensor not taken."""
        records = [r.rebind(tensors) for r in self.records]
        return PendingCommit.from_records(records, next(tensors), next(tensors))

    def select(self, index: Tensor) -> "PendingCommit":
        """Keep the sequences ``index`` (``[B']`` int64)."""
        return PendingCommit.from_records([r.select(index) for r in self.records], _take(self.path, index),
                                          _take(self.path_len, index))


def path_end(path: Tensor, path_len: Tensor) -> Tensor:
    """Last node of each path (``[B]`` int64; ``-1`` where ``path_len == 0``)."""
    last = path.gather(1, (path_len - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(path_len > 0, last, torch.full_like(last, -1))


def take_accepted(per_node: Tensor, current: Tensor, path: Tensor, path_len: Tensor) -> Tensor:
    """The snapshot commit of one state tensor: ``per_node[b, end_b]`` (the value after the
    accepted path's last node, ``per_node [B, T, ...]``), or ``current[b]`` (``[B, ...]``) where
    ``path_len == 0``, bit-identical there."""
    end = path_end(path, path_len).clamp(min=0)
    picked = per_node[torch.arange(per_node.shape[0], device=per_node.device), end]
    keep = (path_len > 0).view(-1, *([1] * (current.dim() - 1)))
    return torch.where(keep, picked, current)
