"""SDC analysis: a healthy and a faulty replica in lockstep (levels 1-3), SDC fault models."""

from attnchecker.sdc.faults import STUDY_NODE, SDCModel
from attnchecker.sdc.lockstep import LockstepConfig, boundaries, run_lockstep, set_determinism

__all__ = [
    "STUDY_NODE",
    "LockstepConfig",
    "SDCModel",
    "boundaries",
    "run_lockstep",
    "set_determinism",
]
