"""Where Hugging Face models meet attnchecker: the family table, discovery, protect_."""

from attnchecker.models.handle import Event, ProtectionHandle
from attnchecker.models.protect import protect_, unprotect_

__all__ = ["Event", "ProtectionHandle", "protect_", "unprotect_"]
