"""Recovery baseline: checkpoint / restore, non-trainable detection."""

from attnchecker.recovery.checkpoint import CheckpointError, CheckpointManager, NonTrainableDetector

__all__ = ["CheckpointError", "CheckpointManager", "NonTrainableDetector"]
