"""Drafters shipped with the core (architecture-independent)."""

from __future__ import annotations

from ..errors import UnknownPluginError
from ..interfaces import Drafter
from .ngram import NgramDrafter

BUILTIN_DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter}


def make_drafter(drafter: str | Drafter) -> Drafter:
    """A drafter instance from a name (``"ngram"``) or an instance (returned as is).

    Raises:
        UnknownPluginError: unknown name; the message lists the known drafters.
        TypeError: neither a name nor a :class:`Drafter`.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        if drafter not in BUILTIN_DRAFTERS:
            raise UnknownPluginError(f"unknown drafter {drafter!r}; available drafters: {', '.join(BUILTIN_DRAFTERS)}")
        return BUILTIN_DRAFTERS[drafter]()
    raise TypeError(f"drafter must be a name or a specla.Drafter, got {type(drafter).__name__}")


__all__ = ["BUILTIN_DRAFTERS", "NgramDrafter", "make_drafter"]
