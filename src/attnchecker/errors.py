"""Exceptions raised at attnchecker's boundaries (the hot path keeps errors as tensor state)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AttnCheckerError",
    "CheckpointError",
    "ConfigError",
    "NoMatchingModuleError",
    "UncorrectableFaultError",
    "UnsupportedModelError",
]


class AttnCheckerError(Exception):
    """Base class of every error attnchecker raises on purpose."""


class ConfigError(AttnCheckerError, ValueError):
    """A configuration value is invalid; the message says how to fix it."""


class CheckpointError(AttnCheckerError):
    """A checkpoint is missing, truncated or corrupted."""


class NoMatchingModuleError(AttnCheckerError, ValueError):
    """A configuration selected no module of the model."""


class UnsupportedModelError(AttnCheckerError):
    """protect_ does not understand the model (its family, a module, an option): the message says
    what, and lists the supported families where that helps."""


class UncorrectableFaultError(AttnCheckerError):
    """A detected fault could not be corrected and the policy is to raise. ``events``: every
    event of the drain that raised (the handle's logs are already reset: they live on here)."""

    def __init__(self, message: str, events: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.events = list(events)
