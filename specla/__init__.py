"""specla: speculative decoding for linear-attention and state-space language models.

The core is architecture-agnostic; architectures arrive as plugins through the
``specla.plugins`` entry-point group (see ``docs/architecture.md``).
"""

from .acceptance import accept_greedy
from .api import RunResult, SpecDecoder, run
from .config import SpecConfig
from .engine import Engine, RunStats
from .errors import (
    BudgetError,
    ConfigError,
    DrafterError,
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
from .interfaces import ArchitecturePlugin, Drafter, TargetAdapter, VerifyOutput
from .records import Acceptance, PendingCommit, Record
from .tree import DraftTree

__version__ = "0.1.0"

__all__ = [
    "Acceptance", "ArchitecturePlugin", "BudgetError", "ConfigError", "DrafterError", "DraftTree", "Drafter", "Engine",
    "InvalidTokenError", "InvalidTreeError", "NonFiniteLogitsError", "PendingCommit", "PluginConflictWarning",
    "PluginLoadWarning", "Record", "RunResult", "RunStats", "SpecConfig", "SpecDecoder", "SpecError", "TargetAdapter",
    "TokenTypeError", "UnknownPluginError", "UnsupportedModelError", "VerifyOutput", "accept_greedy", "run",
]
