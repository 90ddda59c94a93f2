"""Drafters shipped with the core (architecture-independent)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UnknownPluginError
from ..interfaces import Drafter
from .eagle import EagleDrafter, is_eagle_dir
from .ngram import NgramDrafter

BUILTIN_DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter}


def make_drafter(drafter: str | Path | Drafter) -> Drafter:
    """A drafter instance from a name (``"ngram"``), a directory saved by ``specla
    train-drafter`` (an EAGLE drafter), or an instance (returned as is).

    Raises:
        UnknownPluginError: unknown name; the message lists the known drafters.
        TypeError: neither a name, a drafter directory nor a :class:`Drafter`.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, (str, Path)) and is_eagle_dir(drafter):
        return EagleDrafter.from_dir(drafter)
    if isinstance(drafter, (str, Path)) and Path(drafter).is_dir():
        hint = " (a `--stop-at` run? finish it with --resume)" if (Path(drafter) / "checkpoint.pt").is_file() else ""
        raise UnknownPluginError(f"{drafter} is not a trained drafter directory{hint}")
    if isinstance(drafter, str):
        if drafter not in BUILTIN_DRAFTERS:
            raise UnknownPluginError(
                f"unknown drafter {drafter!r}; available drafters: {', '.join(BUILTIN_DRAFTERS)}, "
                "or a directory saved by `specla train-drafter`"
            )
        return BUILTIN_DRAFTERS[drafter]()
    raise TypeError(f"drafter must be a name or a specla.Drafter, got {type(drafter).__name__}")


__all__ = ["BUILTIN_DRAFTERS", "EagleDrafter", "NgramDrafter", "make_drafter"]
