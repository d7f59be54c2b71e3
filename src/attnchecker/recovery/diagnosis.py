"""Diagnosis: was it the hardware, and which rank? Every event and every non-trainable step is
classified, so that a user is told "your hardware", "not your hardware", or that this cannot be
told from what was checked.

- **computation fault** (your hardware): a check found a GEMM's output inconsistent with its
  own operands, and recomputing from the same operands gave something else (an event of cause
  ``"fault"``). Where: step, layer, op, module, rank, host, device.
- **numerics**: the loss or the gradients are NaN / INF or the loss spiked, and every check is
  consistent: either nothing was flagged, or what was flagged came out the same when recomputed
  from its operands (an event of cause ``"numerics"``: the operands imply it; the first such op
  in execution order is where the bad values had already arrived, "its inputs were bad"). That
  alone says nothing about the GEMMs that fed those inputs: the verdict is "not your hardware"
  only when every GEMM upstream (of that op, or of the loss) is checked at that step, and
  ``"unknown"`` (:data:`UNKNOWN`) when one is not (the MLPs and the head with
  ``scope="attention"``, an op not in ``ops``, a layer not in ``layers``, an op a schedule leaves
  off that step), naming them. Upstream is execution order: the forward by layer (attention,
  then the MLP; the head last), then the backward from the head down, each layer's MLP before
  its attention (dX of the output projection, then dP / dV, dQ / dK, the Q / K / V
  projections); ops of one stage do not feed one another and weight gradients feed nothing.
  Only GEMMs count: elementwise ops (norms, activations, the loss) are checked by no
  configuration. Without the config (``classify(..., config=handle.config)``) the coverage is
  unknown, and so is the verdict.

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

from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.ops import GRAD_OPS, LINEAR_OPS, OP_TABLE, OPS

__all__ = [
    "UNKNOWN", "VERDICT", "Finding", "Here", "RankCounts", "classify", "gather", "here",
    "outliers", "tally",
]  # fmt: skip

FAULT, NUMERICS = "fault", "numerics"  # as ``Event.cause`` spells them
VERDICT = {FAULT: "your hardware", NUMERICS: "not your hardware"}
UNKNOWN = "unknown"
"""The verdict on numerics with a GEMM upstream that no check covers: the operands imply the
flagged result (or the loss went bad with every check consistent), but a fault in that GEMM
would look the same."""


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
    cause: str  # "fault" or "numerics" (what the checks found)
    verdict: str  # "your hardware", "not your hardware" or "unknown" (what that says of it)
    message: str
    where: str  # this process (rank, host, device)
    ops: tuple[str, ...] = ()  # "layer L op" of the events behind it, in execution order
    trainable: bool = True  # the step's update went ahead (faults corrected, loss finite)

    def to_dict(self) -> dict[str, object]:
        return {"type": "diagnosis", **asdict(self)}


_HEAD = 1 << 20  # the layer of a linear outside the blocks (lm_head, pooler): after the last
# stages of one layer in execution order; ops of one stage do not feed one another
_FORWARD = {o.name: o.stage for o in OP_TABLE if not o.backward}
_BACKWARD = {o.name: o.stage for o in OP_TABLE if o.backward}
_LOSS = (
    0,
    _HEAD,
    _HEAD,
    max(_FORWARD.values()) + 1,
)  # after the head's forward, before the backward
_PROJECTIONS = tuple(o.name for o in OP_TABLE if o.part == "projection" and not o.backward)
_PROJECTION_GRADS = tuple(o.name for o in OP_TABLE if o.part == "projection" and o.backward)


def _stack(e) -> int:
    """1 for a module of an encoder-decoder's decoder (BART's ``model.decoder...``: its layer
    indices restart at 0 and the whole encoder runs before it), 0 otherwise; the head (a linear
    outside the blocks: ``lm_head``, a pooler) runs after both."""
    return _HEAD if e.layer < 0 else int("decoder" in e.module.split("."))


def _order(e) -> tuple[int, int, int, int]:
    """Execution order of an event's op: forward ops by layer (attention, then the MLP; an
    encoder before its decoder; the head last), then the backward's from the head down (each
    layer's MLP, then its attention from the output projection to the Q / K / V projections)."""
    backward = e.op in GRAD_OPS or e.op in LINEAR_OPS[1:]
    stack, layer = _stack(e), _HEAD if e.layer < 0 else e.layer
    if backward:
        return (1, -stack, -layer, _BACKWARD.get(e.op, len(_BACKWARD)))
    return (0, stack, layer, _FORWARD.get(e.op, len(_FORWARD)))


def _name(e) -> str:
    return f"layer {e.layer} {e.op}" if e.layer >= 0 else f"{e.module} {e.op}"


def _span(lo: int, hi: int) -> str:
    return f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}"


def _checked(config: ABFTConfig, layer: int, step: int) -> frozenset[str]:
    """The attention ops of ``layer`` checked at ``step``; with ``scope="all_linear"`` the
    projections of a layer left out of ``layers`` are checked as plain linear layers."""
    ops = config.layer_ops(layer, step)
    if config.scope == "all_linear" and config.layers is not None and layer not in config.layers:
        backward = any(op in config.ops for op in GRAD_OPS)
        ops |= {*_PROJECTIONS, *(_PROJECTION_GRADS if backward else ())}
    return ops


def _why(config: ABFTConfig, layer: int, op: str) -> str:
    if config.schedule is not None:
        return "left off by the schedule" if op in config.layer_ops(layer) else "not scheduled"
    chosen = config.layers is None or layer in config.layers
    return "not in ops" if chosen else "not in layers"


def _attention(
    config: ABFTConfig, step: int, lo: int, hi: int | None, needed: Sequence[str]
) -> list[str]:
    """The ``needed`` attention ops of layers ``lo`` to ``hi - 1`` (None: every layer from
    ``lo`` on, as many as the model has) left unchecked at ``step``, in words."""
    if not needed or (hi is not None and hi <= lo):
        return []
    whole = tuple(needed) == OPS
    if config.schedule is None and config.layers is None:  # the same ops in every layer
        missing = [op for op in needed if op not in config.ops]
        if not missing:
            return []
        ops = ", ".join(missing)
        if hi is not None:
            return [f"{_span(lo, hi)}'s {ops} (not in ops)"]
        return [f"{ops} of every layer{f' from {lo} on' if lo else ''} (not in ops)"]
    listed = sorted(config.layers or {layer for layer, _, _ in config.schedule or ()})
    layers = range(lo, hi) if hi is not None else [layer for layer in listed if layer >= lo]
    rows: list[tuple[int, str, str]] = []  # (layer, ops, why)
    for layer in layers:
        have = _checked(config, layer, step)
        by_why: dict[str, list[str]] = {}
        for op in needed:
            if op not in have:
                by_why.setdefault(_why(config, layer, op), []).append(op)
        for why, ops in by_why.items():
            what = "attention" if whole and len(ops) == len(OPS) else ", ".join(ops)
            if why == "left off by the schedule":
                why += f" at step {step}"
            rows.append((layer, what, why))
    out, i = [], 0
    while i < len(rows):  # consecutive layers with the same gaps in one phrase
        j = i
        while (
            j + 1 < len(rows)
            and rows[j + 1][1:] == rows[i][1:]
            and rows[j + 1][0] == rows[j][0] + 1
        ):
            j += 1
        out.append(f"{_span(rows[i][0], rows[j][0] + 1)}'s {rows[i][1]} ({rows[i][2]})")
        i = j + 1
    if hi is None:  # the layers the config does not name, if the model has any
        have = _checked(config, max(listed) + 1, step) if listed else frozenset()
        missing = [op for op in needed if op not in have]
        if missing:
            what = "the attention" if whole and len(missing) == len(OPS) else ", ".join(missing)
            named = f"layers={config.layers}" if config.layers is not None else "the schedule"
            above = f" from {lo} on" if lo else ""
            out.append(f"{what} of any layer{above} not in {named}, if the model has one")
    return out


def _unchecked(at: tuple[int, int, int, int], config: ABFTConfig | None, step: int) -> list[str]:
    """The GEMMs upstream of the position ``at`` (:func:`_order`, or :data:`_LOSS`) that
    ``config`` leaves unchecked at ``step``, in words; [] when every one is checked. A layer
    index may name several modules (an encoder's and a decoder's layer, a decoder's self- and
    cross-attention): where it does, every layer's attention counts as upstream."""
    if config is None:
        return ["the coverage was not given (classify(..., config=handle.config))"]
    backward, stack, key, stage = at
    forward_all = bool(backward) or key == _HEAD
    if forward_all or stack == 1:  # the whole forward, or the encoder's and part of the decoder
        out = _attention(config, step, 0, None, OPS)
    else:  # the layers below, and this layer's earlier stages
        out = _attention(config, step, 0, key, OPS)
        out += _attention(config, step, key, key + 1, [o for o in OPS if _FORWARD[o] < stage])
    if config.scope != "all_linear":
        reason = "(scope='attention' checks no linear layer outside attention)"
        if backward:
            out.append(f"every layer's MLP and the head, forward and backward {reason}")
        elif forward_all and at >= _LOSS:
            out.append(f"every layer's MLP and the head {reason}")
        elif forward_all:
            out.append(f"every layer's MLP {reason}")
        elif stack == 1:
            below = f" and the decoder's of {_span(0, key)}" if key > 0 else ""
            out.append(f"every MLP of the encoder{below} {reason}")
        elif key > 0:
            mlp = "MLP" if key == 1 else "MLPs"
            out.append(f"the {mlp} of {_span(0, key)} {reason}")
    # with scope="all_linear" every linear layer's dX is checked as soon as any backward op is,
    # which it is when the backward's first flagged op was checked: nothing to add for it
    if backward and key != -_HEAD:  # the backward from the head down to this op
        layer = -key
        grads = [o for o in GRAD_OPS if not o.startswith("dw.")]  # dW feeds nothing
        if stack == -1:  # a decoder's: its layer index names a self- and a cross-attention
            out += _attention(config, step, layer, None, grads)
        else:
            out += _attention(config, step, layer + 1, None, grads)
            out += _attention(
                config, step, layer, layer + 1, [o for o in grads if _BACKWARD[o] < stage]
            )
    return out


def classify(
    events: Sequence,
    *,
    step: int,
    loss: float | None = None,
    history: Sequence[float] = (),
    spike: float = 10.0,
    where: Here | None = None,
    config: ABFTConfig | None = None,
) -> Finding | None:
    """Classify one step from its protection events, its loss and the recent finite losses
    (``history``; a loss above ``spike`` times their median is a spike). None: a healthy step.

    ``config``: what the protection checks (``handle.config``), so that numerics are called
    "not your hardware" only when every GEMM upstream was checked; without it the coverage is
    unknown and so is such a verdict (:data:`UNKNOWN`)."""
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
            f"your hardware: {what} computation fault(s) on {where}; first in {_name(first)} "
            f"({first.kind}, {first.pattern}, {first.module})"
        )
        return Finding(step, FAULT, VERDICT[FAULT], msg, str(where), _ops(faults), trainable)
    if numerics:
        first = numerics[0]
        missing = _unchecked(_order(first), config, first.step)
        seen = (
            f"recomputing {_name(first)} from its operands gives {first.kind} again, so its "
            f"inputs were already bad there ({first.module})"
        )
        advice = "lower the learning rate, clip gradients, or keep that op in a wider dtype"
        if missing:
            msg = (
                f"unknown: numerics, or a fault upstream in a GEMM no check sees. "
                f"{seen[0].upper()}{seen[1:]}, and every check before it was consistent, but "
                f"not every GEMM upstream is known to be checked: {'; '.join(missing)}. To "
                f"tell them apart, check those too or rerun on other hardware; if numerics, "
                f"{advice}"
            )
            return Finding(step, NUMERICS, UNKNOWN, msg, str(where), _ops(numerics), trainable)
        msg = (
            f"not your hardware: {seen}, and every GEMM upstream is checked and was "
            f"consistent: numerics. {advice[0].upper()}{advice[1:]}"
        )
        return Finding(step, NUMERICS, VERDICT[NUMERICS], msg, str(where), _ops(numerics),
                       trainable)  # fmt: skip
    if bad_loss or spiked:
        what = f"the loss is {loss}" if bad_loss else (
            f"the loss spiked to {loss:.4g} (median of the last {len(history)}: "
            f"{statistics.median(history):.4g})"
        )  # fmt: skip
        missing = _unchecked(_LOSS, config, step)
        instability = (
            "a numerical instability (learning rate, overflow in a non-GEMM op or the loss)"
        )
        if missing:
            msg = (
                f"unknown: numerics, or a fault upstream in a GEMM no check sees. "
                f"{what[0].upper()}{what[1:]} with every check consistent (no checked GEMM "
                f"disagreed with its operands), but not every GEMM upstream is known to be "
                f"checked: {'; '.join(missing)}. Either {instability}, or a fault there; to "
                f"tell them apart, check those too or rerun on other hardware"
            )
            return Finding(step, NUMERICS, UNKNOWN, msg, str(where), (), trainable)
        msg = (
            f"not your hardware: {what} with every check consistent (no GEMM disagreed with "
            f"its operands) and every GEMM upstream is checked: {instability}"
        )
        return Finding(step, NUMERICS, VERDICT[NUMERICS], msg, str(where), (), trainable)
    return None


def _ops(events: Iterable) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_name(e) for e in events))


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
    # this rank's devices named quarantine candidates (recovery.ledger: DeviceRecord.evidence)
    quarantine: list[dict] = field(default_factory=list)

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
