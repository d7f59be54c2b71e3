"""attnchecker: keep transformer training alive and correct when hardware computes wrong numbers.

Importing this package loads torch only (no transformers, no matplotlib, no CUDA initialisation).
"""

from attnchecker.abft import Pattern, Report, ValueKind, protected_matmul
from attnchecker.errors import (
    AttnCheckerError,
    ConfigError,
    NoMatchingModuleError,
    UncorrectableFaultError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

__all__ = [
    "AttnCheckerError",
    "ConfigError",
    "NoMatchingModuleError",
    "Pattern",
    "Report",
    "UncorrectableFaultError",
    "UnsupportedModelError",
    "ValueKind",
    "__version__",
    "protected_matmul",
]
