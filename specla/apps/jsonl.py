"""JSONL input of the apps: prompt suites (``specla bench``) and training text (``specla
train-drafter``)."""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterator
from pathlib import Path


def read_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(line number, parsed value)`` of each non-blank line of a JSONL file (``.xz``
    compressed when the name ends so), read lazily.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: naming the file and line: a line that is not JSON; naming the file: a
            corrupt ``.xz`` stream or text that is not UTF-8.
    """
    opener = lzma.open if str(path).endswith(".xz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh, start=1):
                if line.strip():
                    try:
                        yield i, json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{i}: not JSON ({err})") from err
    except (lzma.LZMAError, EOFError) as err:  # EOFError: a truncated .xz stream
        raise ValueError(f"{path}: not a valid .xz file ({err})") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from err
