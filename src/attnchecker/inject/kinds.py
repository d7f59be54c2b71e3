"""Fault kinds, as :mod:`attnchecker.inject` names them: the kinds and their edits are defined
once in :mod:`attnchecker.faults` (which the fused kernels read too; a new kind is added there)
and re-exported here; this module adds the kinds that campaigns and sampled plans draw from by
default."""

from __future__ import annotations

from attnchecker.faults import (
    KERNEL_MODES,
    FaultKind,
    apply_kind,
    exponent_flip,
    exponent_flip_bit,
    flip_bit,
    kernel_edit,
)

__all__ = [
    "DEFAULT_KINDS",
    "KERNEL_MODES",
    "FaultKind",
    "apply_kind",
    "exponent_flip",
    "exponent_flip_bit",
    "flip_bit",
    "kernel_edit",
]

DEFAULT_KINDS: tuple[str, ...] = tuple(
    k.value for k in (FaultKind.INF, FaultKind.NAN, FaultKind.NEAR_INF, FaultKind.EXPONENT_FLIP)
)
"""The kinds campaigns and sampled fault plans draw from unless told otherwise: the extreme
errors the checks target and the published study's exponent flip."""
