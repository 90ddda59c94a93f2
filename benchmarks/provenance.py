"""What every raw benchmark report records about the run that made it: the commit measured (and
whether the tree was dirty), the device, the library versions, the date and the full command."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries a run's figures depend on (``not installed``
    for a missing one): torch, triton, transformers and FLA's two packages."""
    out = {}
    for name in ("torch", "triton", "transformers", "flash-linear-attention", "fla-core"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def source_commit() -> str:
    """The commit the run measures: ``$SPECLA_COMMIT`` (for a copy of the tree without ``.git``),
    else ``git rev-parse HEAD`` (with ``+dirty`` for uncommitted changes), else ``unknown``."""
    if os.environ.get("SPECLA_COMMIT"):
        return os.environ["SPECLA_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU's (``platform.processor()`` or the machine
    type) with its core count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def provenance(device: str) -> dict:
    """The ``meta`` of a raw report: commit, device, versions, UTC date and the command line."""
    return dict(commit=source_commit(), device=device_name(device), versions=library_versions(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([Path(sys.executable).name, *sys.argv]))
