"""The apps' checks of the paths a user names, each made one way: a file a command reads
(``--config``, ``specla bench --prompts``) and a place it will write (``specla bench --out``,
``specla train-drafter --out``), both before any work is done."""

from __future__ import annotations

import tempfile
from pathlib import Path


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file (``no such file``, ``is a directory``, ``not a
    regular file``: a device such as ``/dev/zero`` that never ends, a pipe, a socket), else None."""
    path = Path(path)
    try:
        if path.is_file():
            return None
        if path.is_dir():
            return "is a directory"
        return "not a regular file" if path.exists() else "no such file"
    except OSError as e:  # a folder on the way that may not be searched
        return e.strerror


def unwritable(path: str | Path) -> str | None:
    """Why ``path`` cannot be written, as ``"<path tried>: <the system's reason>"``, else None.

    An existing file is opened for appending (its contents untouched); otherwise a temporary
    file, gone once closed, is created in ``path`` (an existing folder) or in its nearest existing
    ancestor (where the missing folders would be made). A real write, because permission bits
    do not tell root, a read-only file system or a pseudo one (``/sys``) apart."""
    path = Path(path).absolute()
    try:
        where = path if path.exists() else next(p for p in path.parents if p.exists())
    except OSError as e:  # a folder on the way that may not be searched
        return f"{e.filename}: {e.strerror}"
    if where != path and not where.is_dir():  # no folder can be made under a file
        return f"{where}: Not a directory"
    try:
        if where.is_dir():
            tempfile.TemporaryFile(dir=where).close()
        else:
            where.open("a").close()
    except OSError as e:
        return f"{where}: {e.strerror}"
    return None
