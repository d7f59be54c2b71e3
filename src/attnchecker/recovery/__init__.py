"""Recovery: the checkpoint / restore baseline, non-trainable detection, the guarded optimizer."""

from attnchecker.recovery.checkpoint import CheckpointError, CheckpointManager, NonTrainableDetector
from attnchecker.recovery.guard import GuardedOptimizer, guard

__all__ = [
    "CheckpointError", "CheckpointManager", "GuardedOptimizer", "NonTrainableDetector", "guard",
]  # fmt: skip
