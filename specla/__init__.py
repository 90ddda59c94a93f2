"""specla: speculative decoding for linear-attention and state-space language models.

The core is architecture-agnostic; architectures arrive as plugins through the
``specla.plugins`` entry-point group (see ``docs/architecture.md``).

The names below are imported on first use (PEP 562), so that ``import specla`` (and the
``specla`` command's argument parsing, ``--help`` and ``--version``) does not load torch.
"""

from __future__ import annotations

import importlib.util

from .errors import (
    BudgetError,
    ConfigDeprecationWarning,
    ConfigError,
    ContextLengthWarning,
    DrafterError,
    GenerationInterrupted,
    InvalidTokenError,
    InvalidTreeError,
    NonFiniteLogitsError,
    PluginConflictWarning,
    PluginLoadWarning,
    SpecError,
    TokenTypeError,
    UnknownPluginError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

# name -> the submodule that defines it
_LAZY = {
    "accept_greedy": "acceptance", "RunResult": "api", "SpecDecoder": "api", "run": "api", "EngineOptions": "config",
    "SpecConfig": "config", "Engine": "engine", "RunStats": "engine", "ArchitecturePlugin": "interfaces",
    "Drafter": "interfaces", "TargetAdapter": "interfaces", "VerifyOutput": "interfaces", "Acceptance": "records",
    "PendingCommit": "records", "Record": "records", "DraftTree": "tree",
}

__all__ = [
    "Acceptance", "ArchitecturePlugin", "BudgetError", "ConfigDeprecationWarning", "ConfigError", "ContextLengthWarning", "DrafterError",
    "DraftTree", "Drafter", "Engine", "EngineOptions", "GenerationInterrupted", "InvalidTokenError",
    "InvalidTreeError", "NonFiniteLogitsError", "PendingCommit", "PluginConflictWarning", "PluginLoadWarning",
    "Record", "RunResult", "RunStats", "SpecConfig", "SpecDecoder", "SpecError", "TargetAdapter",
    "TokenTypeError", "UnknownPluginError", "UnsupportedModelError", "VerifyOutput", "accept_greedy", "run",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # ``specla.engine`` after ``import specla``
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
