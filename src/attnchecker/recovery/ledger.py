"""The device ledger: which GPU keeps computing wrong numbers, and the evidence to name it.

A computation fault (an event of cause ``"fault"``: a GEMM's output disagreed with its own
operands, and recomputing from them gave something else) is hardware evidence whatever its
size: a faulty unit is persistent but intermittent (AEGIS, OSDI'26: every one of 18 production
incidents reproduced on the same GPU; 15 of them never showed as a NaN). The ledger keeps, per
device (rank, host, local device index), how many checks fired, where (``"layer L op"``), at
what size (pattern, rows x columns, kind, the delivered value), at which steps, and whether a
replay of a flagged step (``policy="replay"``: :meth:`~attnchecker.models.handle.
ProtectionHandle.rewind`) flagged the same check again.

**The rule.** A device is a *quarantine candidate* once

- computation faults fired at :data:`REPEATS` (2) or more distinct steps within the last
  :data:`WINDOW` (1,000) steps, at any sites (a faulty unit hits whichever GEMM it runs), or
- a replay of a flagged step on it, on the same batch and random state, flagged a computation
  fault at a site the first pass flagged (it reproduced).

A single transient upset (one step; a replay that comes out clean is counted as intermittent
evidence, not as a repeat) names nothing. Numerics (an event of cause ``"numerics"``: the
operands imply the flagged result, an overflow or underflow upstream) are counted apart and
never make a device a candidate. The handle names a device once, in the drain where the rule
first holds (the computation faults of that drain carry
:attr:`~attnchecker.models.handle.Event.quarantine` = True), and keeps it in ``summary()``
(``"devices"``, ``"quarantine"``); the training loop gathers every rank's candidates
(:func:`~attnchecker.recovery.diagnosis.gather`) into ``summary.json``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from attnchecker.recovery.diagnosis import FAULT, NUMERICS, Here

__all__ = ["REPEATS", "WINDOW", "DeviceLedger", "DeviceRecord", "repeats"]

SCHEMA_VERSION = 1
REPEATS = 2  # computation faults at this many distinct steps ...
WINDOW = 1000  # ... within this many steps name the device
_KEEP = 64  # the distinct fault steps a record keeps (the latest)


def _site(e: Any) -> str:
    return f"layer {e.layer} {e.op}" if e.layer >= 0 else f"{e.module} {e.op}"


def _index(device: str) -> int | None:
    """The local index of ``cuda:1`` (1); None for a device without one (``cpu``)."""
    _, _, idx = device.partition(":")
    return int(idx) if idx.isdigit() else None


@dataclass
class DeviceRecord:
    """One device's checks that fired, as plain data (``to_dict`` / ``from_dict``: JSON)."""

    rank: int
    host: str
    device: str  # "cuda:1": the local device index is its number (``index``)
    index: int | None = None
    faults: int = 0  # computation-fault detections
    numerics: int = 0  # detections whose operands imply them: never hardware evidence
    steps: list[int] = field(default_factory=list)  # distinct steps with a fault (latest 64)
    first_step: int | None = None
    last_step: int | None = None
    # "layer L op" -> {"faults", "numerics", "steps" (latest 8), "patterns" {pattern: n},
    # "kinds" {kind: n}, "rows", "cols" (the largest flagged extent), "value" (the largest
    # finite delivered magnitude, None if none)}
    sites: dict[str, dict[str, Any]] = field(default_factory=dict)
    # replays of a step with a computation fault: "reproduced" (the replay flagged a site the
    # first pass flagged: a stuck unit) or "clean" (it did not: intermittent hardware)
    replays: dict[str, int] = field(default_factory=lambda: {"reproduced": 0, "clean": 0})
    reproduced_steps: list[int] = field(default_factory=list)
    candidate: bool = False
    named_at: int | None = None  # the step at which the rule first held
    reason: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def where(self) -> str:
        return f"rank {self.rank}, host {self.host}, device {self.device}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceRecord:
        return cls(**d)

    def evidence(self) -> dict[str, Any]:
        """What names it, for a report: the device, the rule that held, the steps, sites and
        sizes, and how to reproduce it."""
        sizes = {name: _size(s) for name, s in self.sites.items() if s["faults"]}
        return {
            "rank": self.rank, "host": self.host, "device": self.device, "index": self.index,
            "named_at": self.named_at, "reason": self.reason, "faults": self.faults,
            "steps": list(self.steps), "sites": sizes, "replays": dict(self.replays),
            "message": self.message(), "reproduce": self.reproduce(),
        }  # fmt: skip

    def reproduce(self) -> str:
        """How to see it again: the same run (seed, batches) up to the last flagged step, on
        this device and on another; a fault that follows the device is its hardware."""
        on = f"host {self.host}" + (
            f", CUDA_VISIBLE_DEVICES={self.index}" if self.index is not None else ""
        )
        return (
            f"rerun the same seed and batches through step {self.last_step} on {on} "
            f"(policy='replay' replays a flagged step on the spot) and on another device: "
            f"the checks should fire again at steps {_steps(self.steps)} here only"
        )

    def message(self) -> str:
        """One line naming it, for the exit message of a run."""
        sites = ", ".join(n for n, s in self.sites.items() if s["faults"])
        return (
            f"quarantine candidate: {self.where}: {self.reason}; {self.faults} computation "
            f"fault(s) at steps {_steps(self.steps)} in {sites}"
        )


def _size(s: dict[str, Any]) -> str:
    """A site's faults in words: how many, their patterns and kinds, the largest flagged
    extent (beyond one element) and delivered magnitude."""
    text = f"{s['faults']} x {'/'.join(s['patterns'])} {'/'.join(s['kinds'])}"
    if max(s["rows"], s["cols"]) > 1:
        text += f", up to {s['rows']} rows x {s['cols']} columns"
    return text + (f", |y| <= {s['value']:.3g}" if s["value"] is not None else "")


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (f" ... {steps[-1]}" if len(steps) > 8 else "")


def repeats(record: DeviceRecord, *, window: int = WINDOW, at: int = REPEATS) -> str:
    """Why ``record``'s device is a quarantine candidate (the rule of the module docstring), or
    "" when it is not. Numerics never count."""
    if record.replays["reproduced"]:
        return (
            f"a replay of step {record.reproduced_steps[0]} on the same batch and random state "
            f"flagged the same check again"
        )
    if not record.steps:
        return ""
    recent = [s for s in record.steps if s > record.steps[-1] - window]
    if len(recent) >= at:
        return f"computation faults at {len(recent)} distinct steps within {window} steps"
    return ""


class DeviceLedger:
    """Per device, the checks of one protected model that fired (:class:`DeviceRecord`); fed
    by every drain (:meth:`observe`), told of a replay by :meth:`rewound`."""

    def __init__(self, *, window: int = WINDOW, at: int = REPEATS) -> None:
        self.window, self.at = window, at
        self.records: dict[Here, DeviceRecord] = {}
        self._replaying = False
        self._last: dict[Here, tuple[int, set[str]]] = {}  # the last drain's fault sites

    @property
    def idle(self) -> bool:
        """A drain without events has nothing to tell it (no replay pending, no first pass
        kept for one)."""
        return not self._replaying and not self._last

    def rewound(self) -> None:
        """The next drain is a replay of the step drained last."""
        self._replaying = True

    def observe(self, events: Iterable[Any], where: Here) -> DeviceRecord | None:
        """Add one drain's events on ``where``; the record if this drain names it."""
        replay, self._replaying = self._replaying, False
        faults = [e for e in events if e.cause == FAULT]
        rec = self.records.get(where)
        if rec is None and not events:
            return None
        if rec is None:
            rec = self.records[where] = DeviceRecord(
                where.rank, where.host, where.device, _index(where.device)
            )
        first = self._last.pop(where, None)
        if replay and first is not None:  # the replay of a step whose checks flagged a fault
            again = first[1] & {_site(e) for e in faults}
            rec.replays["reproduced" if again else "clean"] += 1
            if again:
                rec.reproduced_steps.append(first[0])
        for e in events:
            _add(rec, e)
        if faults:
            step = max(e.step for e in faults)
            self._last[where] = (step, {_site(e) for e in faults})
            for s in sorted({e.step for e in faults}):
                if s not in rec.steps:
                    rec.steps = sorted([*rec.steps, s])[-_KEEP:]
            if rec.first_step is None or rec.steps[0] < rec.first_step:
                rec.first_step = rec.steps[0]
            rec.last_step = rec.steps[-1]
        if rec.candidate:
            return None
        reason = repeats(rec, window=self.window, at=self.at)
        if not reason:
            return None
        rec.candidate, rec.reason = True, reason
        rec.named_at = rec.last_step
        return rec

    def candidates(self) -> list[DeviceRecord]:
        return [r for r in self.records.values() if r.candidate]

    def to_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records.values()]


def _add(rec: DeviceRecord, e: Any) -> None:
    """One event into its device's record and its site's."""
    s = rec.sites.setdefault(_site(e), {"faults": 0, "numerics": 0, "steps": [],
                                        "patterns": {}, "kinds": {}, "rows": 0, "cols": 0,
                                        "value": None})  # fmt: skip
    if e.cause == NUMERICS:
        rec.numerics += e.count
        s["numerics"] += e.count
        return
    rec.faults += e.count
    s["faults"] += e.count
    if e.step not in s["steps"]:
        s["steps"] = [*s["steps"], e.step][-8:]
    s["patterns"][e.pattern] = s["patterns"].get(e.pattern, 0) + e.count
    s["kinds"][e.kind] = s["kinds"].get(e.kind, 0) + e.count
    s["rows"], s["cols"] = max(s["rows"], e.n_rows), max(s["cols"], e.n_cols)
    value = getattr(e, "value", None)
    if value is not None and math.isfinite(value):
        s["value"] = max(abs(value), s["value"] or 0.0)
