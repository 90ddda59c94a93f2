"""The research baselines SpecLA's factor commit is compared with (docs/architecture.md, "Commit
strategies"): ``snapshot`` (one state per node, the accepted node's kept: what vLLM and SGLang do
for trees) and ``replay`` (the accepted tokens' recurrence inputs run again from the pre-step
state, FLA-SD style). Neither is part of a plugin's contract: a :class:`specla.mixers.Mixer`
declares the ones it runs in :attr:`~specla.mixers.Mixer.baselines`, and a model runs a baseline
only where every mixer declares it (:func:`check_baselines`).

One record serves each baseline for every op: :class:`SnapshotRecord` holds every state tensor's
value after each node (from :meth:`~specla.mixers.Mixer.node_states`), :class:`ReplayRecord` the
per-token inputs a mixer's :meth:`~specla.mixers.Mixer.replay` runs again.

Shapes: ``B`` sequences, ``T`` verified nodes with the root explicit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from .errors import ConfigError
from .records import LayerCommit, Record, take_accepted

if TYPE_CHECKING:
    from .mixers.base import Mixer, TreePass

BASELINES = ("snapshot", "replay")
"""The commit strategies other than ``factor`` (``SpecConfig.engine.commit``)."""


@dataclass(frozen=True)
class SnapshotRecord(Record):
    """A ``snapshot`` pass's record of one mixer: each tensor of its state (:meth:`Mixer.state`,
    in that order) after every node's root path; the commit keeps the accepted path's last
    node's (:func:`specla.records.take_accepted`)."""

    states: tuple[Tensor, ...]  # [B, T, ...] each: state tensor j ([B, ...]) after each node, its dtype

    def commit(self, mixer: Mixer, path: Tensor, path_len: Tensor) -> None:
        """Set ``mixer``'s state to the values after each row's accepted path (``path [B, P]``
        int64, ``-1`` padded; ``path_len [B]``); a row with ``path_len == 0`` keeps its state
        bit-identical."""
        mixer.set_state(iter([take_accepted(s, now, path, path_len) for s, now in zip(self.states, mixer.state())]))


@dataclass(frozen=True)
class ReplayRecord(Record):
    """A ``replay`` pass's record of one recurrent mixer: the per-token inputs of its recurrence
    and of its short convolution, which :meth:`Mixer.replay` runs again over the accepted tokens."""

    inputs: tuple[Tensor, ...]  # [B, T, ...] each, in the order the mixer's replay takes them (its op's docs)
    conv_x: Tensor | None  # [B, T, Dc] activation dtype, the conv's inputs (None: no short conv)


def check_baselines(mixers: list[Mixer], commit: str) -> None:
    """Refuse a baseline ``commit`` strategy some mixer does not declare.

    Raises:
        ConfigError: ``commit`` is ``snapshot`` or ``replay`` and a mixer's
            :attr:`~specla.mixers.Mixer.baselines` lacks it; the message names the first such
            mixer (its index in the model's mixers and its class).
    """
    if commit not in BASELINES:
        return
    for i, m in enumerate(mixers):
        if commit not in m.baselines:
            raise ConfigError(f"commit={commit!r}: mixer {i} of {len(mixers)} ({type(m).__name__}) does not run the "
                              f"{commit} baseline (it declares {sorted(m.baselines) or 'none'}); every model runs "
                              "commit='factor'")


def baseline_record(mixer: Mixer, record: Record, tp: TreePass) -> Record:
    """The record ``mixer`` keeps from a pass that verified ``record``: in a ``snapshot`` pass a
    :class:`SnapshotRecord` of :meth:`Mixer.node_states` (``record`` itself where that gives
    ``None``), else ``record``."""
    if tp.records != "snapshot":
        return record
    states = mixer.node_states(record, tp)
    return record if states is None else SnapshotRecord(tuple(states))


def commit_record(mixer: Mixer, pending: LayerCommit, kernels: bool) -> None:
    """Commit ``pending.path`` (``[B, P]`` int64, ``pending.path_len [B]``) to ``mixer`` from its
    record of any strategy: a baseline's record by its own rule, any other by
    :meth:`Mixer.commit`."""
    record, path, path_len = pending
    if isinstance(record, SnapshotRecord):
        record.commit(mixer, path, path_len)
    elif isinstance(record, ReplayRecord):
        mixer.replay(record, path, path_len)
    else:
        mixer.commit(pending, kernels)
