"""attnchecker: keep transformer training alive and correct when hardware computes wrong numbers.

Importing this package loads torch only (no transformers, no matplotlib, no CUDA initialisation).
"""

from attnchecker.abft import Pattern, Report, ValueKind, protected_matmul
from attnchecker.attention.config import ABFTConfig
from attnchecker.errors import (
    AttnCheckerError,
    ConfigError,
    NoMatchingModuleError,
    UncorrectableFaultError,
    UnsupportedModelError,
)
from attnchecker.models import Event, ProtectionHandle, protect_, unprotect_
from attnchecker.recovery.guard import GuardedOptimizer, guard
from attnchecker.recovery.replay import Replayer, replay

__version__ = "0.1.0"

__all__ = [
    "ABFTConfig",
    "AttnCheckerError",
    "ConfigError",
    "Event",
    "GuardedOptimizer",
    "NoMatchingModuleError",
    "Pattern",
    "ProtectionHandle",
    "Replayer",
    "Report",
    "UncorrectableFaultError",
    "UnsupportedModelError",
    "ValueKind",
    "__version__",
    "guard",
    "protect_",
    "protected_matmul",
    "replay",
    "unprotect_",
]
