"""Drafters shipped with the core (architecture-independent)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DrafterError, UnknownPluginError
from ..interfaces import Drafter
from ..registry import available, get_plugin
from .eagle import FORMATS, EagleDrafter, saved_format
from .ngram import NgramDrafter

BUILTIN_DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter}


def _looks_like_path(drafter: str | Path) -> bool:
    """Whether ``drafter`` is written as a path: a :class:`~pathlib.Path`, or a string with a path
    separator or starting with ``.`` or ``~``."""
    if isinstance(drafter, Path):
        return True
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return any(sep in drafter for sep in seps) or drafter.startswith((".", "~"))


def model_drafter_owners(name: str) -> list[str]:
    """The plugins whose models bring a drafter called ``name`` (``"mtp"``), sorted; empty for
    any other name."""
    return [n for n in available() if name in get_plugin(n).model_drafters]


def make_drafter(drafter: str | Path | Drafter) -> Drafter:
    """A drafter instance from a name (``"ngram"``), a directory saved by ``specla
    train-drafter`` (an EAGLE drafter), or an instance (returned as is).

    A drafter name is never read as a path, so a folder in the working directory cannot shadow
    it: ``"ngram"`` is the n-gram drafter even beside a folder ``ngram/``, which is given as
    ``"./ngram"``. A :class:`~pathlib.Path`, and a string that contains a path separator or starts
    with ``.`` or ``~``, is a directory; so is any other string that names an existing directory
    and no drafter (``"my-drafter"``).

    Raises:
        UnknownPluginError: an unknown name that is no existing directory either (the message
            lists the known drafters).
        DrafterError: a model's own drafter name (``"mtp"``: only a model can build it, see
            :class:`specla.SpecDecoder`); a path to a directory that does not exist, a file, or a
            directory that is not a trained drafter (every bad drafter path raises this one class).
        TypeError: neither a name, a drafter directory nor a :class:`Drafter`.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if not isinstance(drafter, (str, Path)):
        raise TypeError(f"drafter must be a name or a specla.Drafter, got {type(drafter).__name__}")
    if not _looks_like_path(drafter):
        if drafter in BUILTIN_DRAFTERS:
            return BUILTIN_DRAFTERS[drafter]()
        if owners := model_drafter_owners(drafter):
            raise DrafterError(f"drafter {drafter!r} is a model's own drafter (the {', '.join(owners)} plugins' "
                               "models bring it): pass it to SpecDecoder with such a model")
        if not str(drafter).strip() or not Path(drafter).is_dir():  # "" would be the working directory
            own = sorted({name for plugin in available() for name in get_plugin(plugin).model_drafters})
            names = [*BUILTIN_DRAFTERS, *(f"{name} (a model's own: the {', '.join(model_drafter_owners(name))} "
                                          "plugins')" for name in own)]
            raise UnknownPluginError(
                f"unknown drafter {drafter!r}; available drafters: {', '.join(names)}, "
                "or a directory saved by `specla train-drafter`"
            )
    path = Path(drafter).expanduser()
    if not path.exists():
        raise DrafterError(f"drafter directory {drafter} does not exist")
    if not path.is_dir():
        raise DrafterError(f"drafter {drafter} is not a directory (a drafter is the directory "
                           "`specla train-drafter` wrote)")
    found = saved_format(path)  # config.json read once: a drafter of this specla, of another, or none
    if found in FORMATS:
        return EagleDrafter.from_dir(path)
    if found is not None:
        raise DrafterError(f"drafter {drafter}: config.json names the format {found!r}, which this specla does not "
                           f"read (it reads {', '.join(FORMATS)})")
    hint = " (a `--stop-at` run? finish it with --resume)" if (path / "checkpoint.pt").is_file() else ""
    raise DrafterError(f"{drafter} is not a trained drafter directory{hint}")


__all__ = ["BUILTIN_DRAFTERS", "EagleDrafter", "NgramDrafter", "make_drafter", "model_drafter_owners"]
