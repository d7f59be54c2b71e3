"""Fault injection: pure tensor edits that model hardware faults, seeded plans, the injector."""

from attnchecker.inject.injector import FaultRecord, Injector
from attnchecker.inject.kinds import (
    FaultKind,
    apply_kind,
    exponent_flip,
    exponent_flip_bit,
    flip_bit,
)
from attnchecker.inject.plan import Fault, FaultPattern, FaultPlan, PlanBuilder

__all__ = [
    "Fault",
    "FaultKind",
    "FaultPattern",
    "FaultPlan",
    "FaultRecord",
    "Injector",
    "PlanBuilder",
    "apply_kind",
    "exponent_flip",
    "exponent_flip_bit",
    "flip_bit",
]
