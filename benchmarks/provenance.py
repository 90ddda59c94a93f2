"""What every raw benchmark report records about the run that made it: the commit measured (a
tree with uncommitted changes is refused unless ``--allow-dirty``, and then reads ``<sha>+dirty``),
the device, the library versions, the date and the full command. One implementation:
:func:`specla.apps.bench.provenance`, pointed at this repository's checkout.

Each script adds the option with :func:`add_allow_dirty` and calls :func:`provenance` (or
:func:`print_meta`, for scripts that print JSON lines) before it measures anything. Run as
``python benchmarks/provenance.py [--allow-dirty]``, it is that check alone (the shell recipes run
it before they train).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specla.apps.bench import library_versions, provenance as _provenance  # noqa: F401 (library_versions: re-exported)

ROOT = Path(__file__).resolve().parents[1]


def add_allow_dirty(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--allow-dirty`` to a script's parser."""
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on a working tree with uncommitted changes (refused otherwise); the report's "
                             "commit then reads <sha>+dirty")
    return parser


def provenance(device: str, allow_dirty: bool = False) -> dict:
    """The ``meta`` block of a raw report for ``device`` (``cuda``, ``cuda:N`` or ``cpu``).

    A checkout with uncommitted changes and no ``allow_dirty`` ends the script: one line on
    stderr naming the changed files, exit status 2."""
    try:
        return _provenance(device, root=ROOT, allow_dirty=allow_dirty)
    except ValueError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def print_meta(device: str, allow_dirty: bool = False) -> dict:
    """:func:`provenance`, printed first as one JSON line ``{"meta": {...}}`` (the scripts whose
    output is JSON lines or text); returns it."""
    meta = provenance(device, allow_dirty)
    print(json.dumps({"meta": meta}), flush=True)
    return meta


if __name__ == "__main__":
    provenance("cpu", add_allow_dirty(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args()
               .allow_dirty)
