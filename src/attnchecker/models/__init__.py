"""Where Hugging Face models meet attnchecker: family adapters, ``protect_``/``unprotect_``."""

from attnchecker.models.handle import Event, ProtectionHandle
from attnchecker.models.protect import protect_, unprotect_

__all__ = ["Event", "ProtectionHandle", "protect_", "unprotect_"]
