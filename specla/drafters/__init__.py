"""Drafters shipped with the core (architecture-independent)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DrafterError, UnknownPluginError
from ..interfaces import Drafter
from .eagle import EagleDrafter, is_eagle_dir
from .ngram import NgramDrafter

BUILTIN_DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter}


def _looks_like_path(drafter: str | Path) -> bool:
    """Whether ``drafter`` names a directory rather than a built-in drafter."""
    if isinstance(drafter, Path):
        return True
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return any(sep in drafter for sep in seps) or drafter.startswith((".", "~"))


def make_drafter(drafter: str | Path | Drafter) -> Drafter:
    """A drafter instance from a name (``"ngram"``), a directory saved by ``specla
    train-drafter`` (an EAGLE drafter), or an instance (returned as is).

    A string that looks like a path (it contains a path separator or starts with ``.`` or
    ``~``) and every :class:`~pathlib.Path` is taken as a directory; other strings are names.

    Raises:
        UnknownPluginError: unknown name (the message lists the known drafters).
        DrafterError: a path to a directory that does not exist, a file, or a directory that is
            not a trained drafter (every bad drafter path raises this one class).
        TypeError: neither a name, a drafter directory nor a :class:`Drafter`.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, (str, Path)) and _looks_like_path(drafter):
        given, drafter = drafter, Path(drafter).expanduser()
        if not drafter.exists():
            raise DrafterError(f"drafter directory {given} does not exist")
        if not drafter.is_dir():
            raise DrafterError(f"drafter {given} is not a directory (a drafter is the directory "
                               "`specla train-drafter` wrote)")
    if isinstance(drafter, (str, Path)) and is_eagle_dir(drafter):
        return EagleDrafter.from_dir(drafter)
    if isinstance(drafter, (str, Path)) and Path(drafter).is_dir():
        hint = " (a `--stop-at` run? finish it with --resume)" if (Path(drafter) / "checkpoint.pt").is_file() else ""
        raise DrafterError(f"{drafter} is not a trained drafter directory{hint}")
    if isinstance(drafter, str):
        if drafter not in BUILTIN_DRAFTERS:
            raise UnknownPluginError(
                f"unknown drafter {drafter!r}; available drafters: {', '.join(BUILTIN_DRAFTERS)}, "
                "or a directory saved by `specla train-drafter`"
            )
        return BUILTIN_DRAFTERS[drafter]()
    raise TypeError(f"drafter must be a name or a specla.Drafter, got {type(drafter).__name__}")


__all__ = ["BUILTIN_DRAFTERS", "EagleDrafter", "NgramDrafter", "make_drafter"]
