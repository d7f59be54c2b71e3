"""The record store of one protected module: what its checks found since the last drain, in one
layout that every engine writes and the handle reads once.

Nothing a check writes during a step is a Python value: each check adds its record to a small
float64 tensor with in-place tensor ops, so a compiled model sees no Python int or list that
changes from step to step (dynamo would guard on it and recompile), and the clean path never
synchronises with the device. One layout (:data:`RECORD_FIELDS` per row), and every writer, by
the API it writes through:

1. the forward's check regions (the projections' and linear layers' eager or compiled checks,
   the eager core's): :meth:`Records.note` then :meth:`Records.commit` into ``log``, a row per
   forward op (a checkpointing replay's records compared with the first pass's there);
2. the forward's registered ops that write ``log`` rows themselves, on a flag (the GEMM checks'
   ``proj_repair``, :mod:`~attnchecker.attention.kernel_checks`; the SDPA route's forward
   verify / repair, :mod:`~attnchecker.attention.sdpa_core`): into :meth:`Records.direct_log`
   at :meth:`Records.direct_row` (the log itself; a scratch compared by :meth:`Records.commit`
   in a module that checkpointing replays: the one replay rule);
3. the backward's check regions (:mod:`~attnchecker.attention.grads`: the core's and the linear
   layers'): their records leave the backward as the gradient of the leaf ``sink`` (a row per
   backward op), so autograd accumulates them over layers and steps, compiled backward graphs
   included;
4. the SDPA route's backward: its registered ops fill a records tensor returned as ``sink``'s
   gradient, the same way, at :meth:`Records.direct_row` (``grad=True``);
5. the linear layers' backward by the registered ops: they add into :func:`grad_of` ``sink``
   in place (the one writer that mutates the sink's gradient: autograd then accumulates the
   other writers' gradients into that tensor);
6. the fused kernels: int32 counters (check x detected, corrected, uncorrected) in
   :meth:`Records.direct_counts` (forward, mutated by the kernels: ``kernel``, or a scratch under
   the replay rule, as writer 2) and ``kernel_sink.grad`` (backward, as a gradient), turned into
   rows by :meth:`Records.rows`.

:meth:`Records.reset` (a drain) and :meth:`Records.to` (a move) are the only other writes.

A record's ``detected`` and ``lost`` count checks; the other fields are summed over detecting
checks only (so for one detection between two drains they are that detection's values, and
``step_sum / detected`` is the mean step of several).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from attnchecker.attention import regions
from attnchecker.attention.checks import detected, index_constant, log_rows
from attnchecker.attention.impl import CheckImpl
from attnchecker.attention.ops import OPS
from attnchecker.attention.sites import in_replay

__all__ = ["RECORD_FIELDS", "Records", "grad_of", "new_log", "new_records_sink", "ranged"]

RECORD_FIELDS = ("n_rows", "n_cols", "value", "lost", "reproduced", "detected", "step_sum")
"""One check's record: flagged rows / columns of its unit (tokens and features for a projection;
query rows, twice, for attention), the delivered value at the worst flagged position, whether a
detection was left unrepaired (beyond the repair budget, or the operands were already bad),
whether recomputing from the operands gave a flagged result again (the operands imply it:
numerics, not this GEMM), whether it detected, and the step. The first five are the checks' own
records, in order. A fused kernel's row: n_rows = detected tiles, lost = uncorrected, value NaN
(the kernels do not report one)."""

_LOST = RECORD_FIELDS.index("lost")


def new_log(device: torch.device, n_ops: int = len(OPS)) -> Tensor:
    """A log of ``n_ops`` rows (an attention module's forward ops by default)."""
    return torch.zeros(n_ops, len(RECORD_FIELDS), dtype=torch.float64, device=device)


def new_records_sink(n_ops: int, device: torch.device) -> Tensor:
    """The leaf whose ``.grad`` collects a module's backward records (n_ops, 7) float64."""
    return torch.zeros(n_ops, len(RECORD_FIELDS), dtype=torch.float64, device=device,
                       requires_grad=True)  # fmt: skip


def grad_of(sink: Tensor) -> Tensor:
    """``sink.grad``, made (zeros) where there is none yet: where the linear layers' backward
    by the registered ops adds its records in place (writer 5 of the module docstring); a
    drain zeroes it in place."""
    if sink.grad is None:
        sink.grad = torch.zeros_like(sink)
    return sink.grad


def ranged(label: str):
    """A profiler range per check in eager (benchmarks read them); nothing under compile."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"attnchecker.{label}")


class Records:
    """The records of one protected module: ``ops`` (the forward's rows), ``grad_ops`` (the
    backward's), and, with the fused kernels, their ``checks``. Attached to the module's state
    (a plain attribute, not a buffer: ``state_dict()`` and DDP's broadcast never see it)."""

    def __init__(
        self,
        ops: tuple[str, ...],
        grad_ops: tuple[str, ...],
        log: Tensor,
        *,
        backward: bool = False,
        kernel_checks: tuple[str, ...] = (),
    ) -> None:
        self.ops, self.grad_ops, self.kernel_checks = ops, grad_ops, kernel_checks
        self.log = log  # (len(ops), 7) float64 on the module's device
        self.sink = new_records_sink(len(grad_ops), log.device) if backward else None
        self.kernel: Tensor | None = None  # (len(checks), 3) int32, the forward kernels'
        self.kernel_sink: Tensor | None = None  # its .grad: the backward kernels' counters
        if kernel_checks:
            from attnchecker.kernels.flash import new_counts
            from attnchecker.kernels.ops import new_sink as new_kernel_sink

            self.kernel = new_counts(log.device)
            self.kernel_sink = new_kernel_sink(log.device)
        self._row = {o: i for i, o in enumerate(ops)}
        self._grad_row = {o: i for i, o in enumerate(grad_ops)}
        self._noted: list[tuple[tuple[str, ...], Tensor]] = []  # this layer's, until commit()
        # the records of the last first pass (not a replay) per committed op tuple: what a
        # checkpointing replay's records are compared with
        self._first: dict[tuple[str, ...], Tensor] = {}
        # the registered ops that write log rows themselves: where they write until commit()
        # once a checkpointing replay has reached the module (direct_log), and their last first
        # pass's rows
        self.replayed = False
        self._direct: dict[str, list[Tensor]] = {"log": [], "kernel": []}
        self._first_direct: dict[str, Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        """What each row of :meth:`rows` records."""
        return (*self.ops, *self.grad_ops, *self.kernel_checks)

    def note(self, ops: tuple[str, ...], rec: Tensor) -> None:
        """Keep the (len(ops), 5) float32 records [rows, cols, value, lost, reproduced] of one
        check until :meth:`commit` writes the layer's records to the log in one go."""
        self._noted.append((ops, rec))

    def noted_device(self) -> torch.device | None:
        """The device of the noted records (None: nothing noted)."""
        return self._noted[0][1].device if self._noted else None

    def commit(self, step: Tensor, how: CheckImpl) -> None:
        """Add the layer's records to the log, the noted ones at the clock ``step``. The one
        replay rule, for every writer of the forward: a checkpointing replay repeats a forward
        already counted, so its records are counted where they differ from the first pass's (a
        fault that hit the replay alone, or a different one), and dropped where they are the same
        (what the operands imply, such as an overflow upstream, comes back in every replay).
        ``how``: how the records region runs. The caller has moved the records to the noted
        ones' device (:meth:`~attnchecker.attention.state.AttentionState.follow`)."""
        for name in self._direct:
            if self._direct[name]:
                self._commit_direct(name)
        if not self._noted:
            return
        ops = tuple(o for names, _ in self._noted for o in names)
        noted = [r for _, r in self._noted]
        self._noted = []
        first, replay = None, in_replay()  # eager only (compiled code does not replay Python)
        if replay:
            first = self._first.get(ops)
            if first is not None and first.shape[0] != sum(r.shape[0] for r in noted):
                first = None
        recs, rows = regions.run(_records_region, how, noted, step, first)
        if not replay and not torch.compiler.is_compiling():
            self._first[ops] = recs  # (a traced dict write would be a side effect)
        self.log.index_add_(0, self._index(ops, recs.device), rows)

    def direct_row(self, *ops: str, on: Callable[[str], bool], grad: bool = False) -> int:
        """Where a registered op that writes its records itself writes the first of ``ops``
        that ``on`` (the schedule) checks now: its row in :meth:`direct_log` (``grad``: in the
        backward's records); -1 for none."""
        rows = self._grad_row if grad else self._row
        return next((rows[o] for o in ops if on(o)), -1)

    def direct_log(self) -> Tensor:
        """The tensor a registered op that writes its forward records itself writes them to:
        the log, on the clean path (no copy, no launch); in a module a checkpointing replay has
        reached (learned at its first replay; every pass from then on, first passes included),
        a zeroed scratch of the log's shape that :meth:`commit` adds to the log by the replay
        rule, as the noted records. The first replayed step has no first pass kept to compare
        with: that replay's records of these ops are dropped (counted by the first pass where
        the operands imply them; a fault in that replay alone is corrected uncounted)."""
        return self._direct_target("log")

    def direct_counts(self) -> Tensor | None:
        """Where the fused kernels' forward adds its counters: ``kernel``, or as
        :meth:`direct_log` a scratch of its shape in a module that checkpointing replays."""
        return None if self.kernel is None else self._direct_target("kernel")

    def _direct_target(self, name: str) -> Tensor:
        own = getattr(self, name)
        if torch.compiler.is_compiling():  # (compiled code does not replay Python)
            return own
        if not self.replayed and in_replay():
            self.replayed = True
        if not self.replayed:
            return own
        scratch = torch.zeros_like(own)
        self._direct[name].append(scratch)
        return scratch

    def _commit_direct(self, name: str) -> None:
        """The scratches of :meth:`direct_log` (``name`` "log") or :meth:`direct_counts`
        ("kernel") into their tensor, by the replay rule."""
        parts, self._direct[name] = self._direct[name], []
        rows = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        if in_replay():
            first = self._first_direct.get(name)
            if first is None:  # the first replay: its first pass wrote the tensor itself
                return
            same = (rows == first) | (rows.isnan() & first.isnan())
            rows = rows.masked_fill(same.all(1, keepdim=True), 0)
        else:
            self._first_direct[name] = rows
        getattr(self, name).add_(rows)

    def _index(self, ops: tuple[str, ...], device: torch.device) -> Tensor:
        """The log rows of ``ops`` (a cached constant: not a host-to-device copy a step)."""
        return index_constant(tuple(self._row[o] for o in ops), device)

    def kernel_counts(self) -> Tensor | None:
        """The fused kernels' counters so far, forward and backward (int32, on the device)."""
        if self.kernel is None:
            return None
        grad = None if self.kernel_sink is None else self.kernel_sink.grad
        return self.kernel if grad is None else self.kernel + grad.to(torch.int32)

    def rows(self, step: Tensor) -> Tensor:
        """Every record since the last drain, (len(names), 7) float64 on the log's device (a
        kernel row's step is ``step``, the clock now: the kernels do not record one)."""
        dev = self.log.device
        parts = [self.log]
        if self.grad_ops:
            grad = None if self.sink is None else self.sink.grad
            parts.append(
                self.log.new_zeros(len(self.grad_ops), len(RECORD_FIELDS))
                if grad is None
                else grad.to(dev)
            )
        kern = self.kernel_counts()
        if kern is not None:  # (checks, 3): detected, corrected, uncorrected
            det, unc = kern[:, 0:1].to(dev, torch.float64), kern[:, 2:3].to(dev, torch.float64)
            nan, zero = torch.full_like(det, torch.nan), torch.zeros_like(det)
            at = step.to(dev, torch.float64).view(1, 1) * det
            # n_rows, n_cols, value, lost, reproduced, detected, step_sum
            parts.append(torch.cat([det, zero, torch.where(det > 0, nan, 0.0), unc, zero, det,
                                    at], 1))  # fmt: skip
        return torch.cat(parts)

    def lost(self) -> Tensor:
        """The lost (uncorrectable) checks since the last drain, a 0-dim float64 tensor."""
        total = self.log[:, _LOST].sum()
        if self.sink is not None and self.sink.grad is not None:
            total = total + self.sink.grad[:, _LOST].sum().to(total.device)
        kern = self.kernel_counts()
        if kern is not None:
            total = total + kern[:, 2].sum().to(total.device)
        return total

    def to(self, device: torch.device) -> None:
        """Follow the model to ``device`` (moved after protect_), records kept: the log and
        the forward kernels' counters are copied, the backward's sinks are new leaves there
        (an autograd function returns its records' gradient on its inputs' device) that carry
        what they had collected."""
        self.log = self.log.to(device)
        if self.kernel is not None:
            self.kernel = self.kernel.to(device)
        for name in ("sink", "kernel_sink"):
            old = getattr(self, name)
            if old is not None:
                new = old.detach().to(device).requires_grad_()
                new.grad = None if old.grad is None else old.grad.to(device)
                setattr(self, name, new)
        self._first.clear()  # a replay's first pass is compared on the device it ran on
        self._first_direct = {}
        self._direct = {"log": [], "kernel": []}

    def reset(self) -> None:
        """Forget what was read (a drain). Everything is zeroed in place, the backward's
        sinks' ``.grad`` too (autograd then accumulates into the same memory): a step captured
        in a CUDA graph writes its records where the drain reads them."""
        self.log.zero_()
        for sink in (self.sink, self.kernel_sink):
            if sink is not None and sink.grad is not None:
                sink.grad.zero_()
        if self.kernel is not None:
            self.kernel.zero_()


def _records_region(
    noted: list[Tensor], step: Tensor, first: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The (n, 5) records of a layer's checks, in order, and their log rows (n, 7)
    (:data:`RECORD_FIELDS`, zero where a check did not detect: a NaN value of an undetected
    check must not leak); ``first``: the first pass's records of a replay, whose equal
    records are dropped."""
    recs = torch.cat(noted) if len(noted) > 1 else noted[0]
    det = detected(recs)  # (n, 1)
    if first is not None:
        same = ((recs == first) | (recs.isnan() & first.isnan())).all(1, keepdim=True)
        det = det & ~same
    return recs, log_rows(recs, det, step)
