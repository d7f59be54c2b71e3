"""Recovery: the checkpoint / restore baseline, non-trainable detection, the guarded optimizer,
the replay of a step that went wrong."""

from attnchecker.recovery.checkpoint import CheckpointError, CheckpointManager, NonTrainableDetector
from attnchecker.recovery.guard import GuardedOptimizer, guard
from attnchecker.recovery.replay import Replayer, replay

__all__ = [
    "CheckpointError", "CheckpointManager", "GuardedOptimizer", "NonTrainableDetector", "Replayer",
    "guard", "replay",
]  # fmt: skip
