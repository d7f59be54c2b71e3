"""Integrations with training frameworks."""

from attnchecker.integrations.trainer import AttnCheckerCallback

__all__ = ["AttnCheckerCallback"]
