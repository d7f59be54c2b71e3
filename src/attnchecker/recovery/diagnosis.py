"""Diagnosis: was it the hardware, and which rank? Every event and every non-trainable step is
classified, so that a user is told "your hardware" or "not your hardware".

- **computation fault** (your hardware): a check found a GEMM's output inconsistent with its
  own operands, and recomputing from the same operands gave something else (an event of cause
  ``"fault"``). Where: step, layer, op, module, rank, host, device.
- **numerics** (not your hardware): the loss or the gradients are NaN / INF or the loss spiked,
  and every check is consistent: either nothing was flagged, or what was flagged came out the
  same when recomputed from its operands (an event of cause ``"numerics"``: the operands imply
  it; the first such op in execution order is where the overflow entered, "its inputs grew").

Across ranks (DDP, FSDP2: any process group) :func:`gather` collects every rank's counts and
:func:`outliers` names the rank whose computation faults stand out, as users of large clusters
ask ("how did you identify the bad node?"): ``rank 3, host h2, device cuda:1: 12 corrected
faults in 1,000 steps; others 0``.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from attnchecker.attention.config import ALL_OPS, GRAD_OPS, LINEAR_OPS

__all__ = ["Finding", "Here", "RankCounts", "classify", "gather", "here", "outliers", "tally"]

FAULT, NUMERICS = "computation_fault", "numerics"
VERDICT = {FAULT: "your hardware", NUMERICS: "not your hardware"}


@dataclass(frozen=True)
class Here:
    """Where this process runs."""

    rank: int
    host: str
    device: str

    def __str__(self) -> str:
        return f"rank {self.rank}, host {self.host}, device {self.device}"


def here(device: torch.device | str | None = None) -> Here:
    """This process: its rank in the default process group (0 without one), host and device."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return Here(rank, os.environ.get("ATTNCHECKER_HOST") or socket.gethostname(), str(dev))


@dataclass(frozen=True)
class Finding:
    """The diagnosis of one step."""

    step: int
    cause: str  # "computation_fault" or "numerics"
    verdict: str  # "your hardware" or "not your hardware"
    message: str
    where: str  # this process (rank, host, device)
    ops: tuple[str, ...] = ()  # "layer L op" of the events behind it, in execution order
    trainable: bool = True  # the step's update went ahead (faults corrected, loss finite)

    def to_dict(self) -> dict[str, object]:
        return {"type": "diagnosis", **asdict(self)}


def _order(e) -> tuple[int, int, int]:
    """Execution order of an event's op: forward ops by layer, then the backward's in reverse."""
    i = ALL_OPS.index(e.op) if e.op in ALL_OPS else len(ALL_OPS)
    backward = e.op in GRAD_OPS or e.op in LINEAR_OPS[1:]
    return (int(backward), -e.layer if backward else e.layer, i)


def classify(
    events: Sequence,
    *,
    step: int,
    loss: float | None = None,
    history: Sequence[float] = (),
    spike: float = 10.0,
    where: Here | None = None,
) -> Finding | None:
    """Classify one step from its protection events, its loss and the recent finite losses
    (``history``; a loss above ``spike`` times their median is a spike). None: a healthy step."""
    where = where or here()
    bad_loss = loss is not None and not math.isfinite(loss)
    spiked = (
        loss is not None
        and not bad_loss
        and len(history) >= 3
        and loss > spike * max(statistics.median(history), 1e-12)
    )
    faults = sorted((e for e in events if e.cause == "fault"), key=_order)
    numerics = sorted((e for e in events if e.cause == "numerics"), key=_order)
    lost = any(e.action == "uncorrectable" for e in events)
    trainable = not (bad_loss or lost)
    if faults:
        first = faults[0]
        fixed = sum(e.count for e in faults if e.action != "uncorrectable")
        left = sum(e.count for e in faults if e.action == "uncorrectable")
        what = f"{fixed} corrected" + (f", {left} beyond repair (step skipped)" if left else "")
        msg = (
            f"your hardware: {what} computation fault(s) on {where}; first in layer "
            f"{first.layer} {first.op} ({first.kind}, {first.pattern}, {first.module})"
        )
        return Finding(step, FAULT, VERDICT[FAULT], msg, str(where), _ops(faults), trainable)
    if numerics:
        first = numerics[0]
        msg = (
            f"not your hardware: recomputing layer {first.layer} {first.op} from its operands "
            f"gives {first.kind} again, so its inputs overflowed there ({first.module}); every "
            f"check is consistent. Lower the learning rate, clip gradients, or keep that op in "
            f"a wider dtype"
        )
        return Finding(step, NUMERICS, VERDICT[NUMERICS], msg, str(where), _ops(numerics),
                       trainable)  # fmt: skip
    if bad_loss or spiked:
        what = f"the loss is {loss}" if bad_loss else (
            f"the loss spiked to {loss:.4g} (median of the last {len(history)}: "
            f"{statistics.median(history):.4g})"
        )  # fmt: skip
        msg = (
            f"not your hardware: {what} with every check consistent (no GEMM disagreed with "
            f"its operands): a numerical instability (learning rate, overflow in a non-GEMM op "
            f"or the loss)"
        )
        return Finding(step, NUMERICS, VERDICT[NUMERICS], msg, str(where), (), trainable)
    return None


def _ops(events: Iterable) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f"layer {e.layer} {e.op}" for e in events))


@dataclass
class RankCounts:
    """One rank's tally over a run (or since protection)."""

    rank: int
    host: str
    device: str
    steps: int = 0
    faults: int = 0  # computation faults detected (corrected or not)
    uncorrectable: int = 0  # of which beyond repair
    numerics: int = 0  # steps diagnosed numerics
    by_op: dict[str, int] = field(default_factory=dict)  # computation faults per op

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def __str__(self) -> str:
        fixed = self.faults - self.uncorrectable
        text = f"rank {self.rank}, host {self.host}, device {self.device}: {fixed:,} corrected"
        if self.uncorrectable:
            text += f" and {self.uncorrectable:,} uncorrectable"
        return f"{text} fault(s) in {self.steps:,} steps"


def tally(counts: RankCounts, events: Iterable, finding: Finding | None) -> None:
    """Add one step's events and diagnosis to ``counts``."""
    counts.steps += 1
    for e in events:
        if e.cause == "fault":
            counts.faults += e.count
            counts.uncorrectable += e.count if e.action == "uncorrectable" else 0
            counts.by_op[e.op] = counts.by_op.get(e.op, 0) + e.count
    if finding is not None and finding.cause == NUMERICS:
        counts.numerics += 1


def gather(counts: RankCounts, group: dist.ProcessGroup | None = None) -> list[RankCounts]:
    """Every rank's counts, on every rank (collective; just ``[counts]`` without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [counts]
    out: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, counts.to_dict(), group=group)
    return [RankCounts(**d) for d in out if d is not None]


def outliers(ranks: Sequence[RankCounts], *, factor: float = 4.0) -> list[str]:
    """The ranks whose computation faults stand out, each named with the others' counts: a
    rank with faults while the median of the others is at most 1/``factor`` of its count."""
    named = []
    for r in ranks:
        others = [o.faults for o in ranks if o is not r]
        if r.faults == 0:
            continue
        base = statistics.median(others) if others else 0
        if r.faults >= factor * max(base, 0.25):
            rest = ", ".join(f"{n:,}" for n in sorted(set(others))) if others else "none"
            named.append(f"{r}; others {rest}")
    return named
