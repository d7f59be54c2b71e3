"""``policy="replay"``: a step that goes wrong is recomputed once before the optimizer steps.

A step *goes wrong* when protection recorded an uncorrectable error (its
:meth:`~attnchecker.models.handle.ProtectionHandle.found_inf`), or the loss or a gradient is not
finite. It is then recomputed on the same batch with the same random state (the CPU and CUDA
generators as they stood before it: the same dropout masks) and the same checks (the handle's
clock and schedule go back one step):

- the replay is clean: the fault was *transient* (a particle, a voltage droop); its update is
  applied and nothing is lost but one step's compute;
- the replay goes wrong again: *reproduced*. Either a fault that stays (a stuck unit: the checks
  flag a computation fault again, "your hardware") or numerics (the same batch, weights and random
  state give the same NaN / INF: not a fault, or one in a GEMM no check sees, which the diagnosis
  says). The update is skipped, as ``skip_step`` does.

This is how large training runs handle a suspicious step (Megatron-LM's rerun state machine
replays a step whose loss is NaN or spiked to tell a transient fault from a persistent one or a
numerical problem). It needs the step's batch again, so it wraps the step, as a closure:

    step = attnchecker.replay(torch.optim.AdamW(model.parameters(), fused=True), handle)
    for batch in data:
        def closure():
            loss = model(**batch).loss
            loss.backward()
            return loss
        out = step.step(closure)          # out.replayed, out.skipped, out.events, out.finding
        step.zero_grad()

:class:`Replayer` reads its decision in one host transfer per step, the handle's drain (it drains
the handle: the events come back in ``out.events``); without protection (the finite-gradient
guard alone, ``handle=None``) it reads one flag. Under ``torch.distributed`` the flag is
max-reduced over the process group before it is read, so every rank replays, applies or skips
together. With a ``torch.amp.GradScaler`` the scaler steps the optimizer: a replay that comes out
finite spares it a back-off, a reproduced overflow is the scaler's to skip (its scale backs off,
as without protection); a reproduced uncorrectable error is skipped without calling the scaler.
``Replayer(..., replay=False)`` skips a step that went wrong at once, with the same test and the
same one read (``skip_step`` for a loop that decides on the host: campaigns, simulations).
``attnchecker train --policy replay`` runs the same decision in its own loop
(:mod:`attnchecker.train.loop`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnchecker.recovery.diagnosis import FAULT, UNKNOWN, VERDICT, classify, here
from attnchecker.recovery.guard import nonfinite

__all__ = ["RandomState", "Replayed", "Replayer", "replay", "verdict"]

TRANSIENT, PERSISTENT, NUMERICS = "transient", "persistent fault", "numerics"


@dataclass(frozen=True)
class RandomState:
    """The global generators (CPU, every CUDA device) as they stood before a step."""

    cpu: Tensor
    cuda: tuple[Tensor, ...] = ()

    @classmethod
    def capture(cls) -> RandomState:
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(list(self.cuda))


@dataclass(frozen=True)
class Replayed:
    """What :meth:`Replayer.step` did with one step."""

    loss: Any  # the closure's return value (the replay's, when the step was replayed)
    replayed: bool = False
    skipped: bool = False  # the replay went wrong too: the update was not applied
    events: list = field(default_factory=list)  # protection's events, both passes
    finding: str | None = None  # transient / persistent fault / numerics (None: a clean step)
    message: str = ""


def verdict(
    first: Sequence,
    again: Sequence,
    *,
    reproduced: bool,
    checked: bool,
    step: int = 0,
    loss: float | None = None,
    config: Any = None,
) -> tuple[str, str]:
    """(finding, message) of a replayed step: ``first`` and ``again`` are protection's events of
    its two passes, ``checked`` whether anything was checked at all."""
    if not reproduced:
        return TRANSIENT, (
            "transient: the replay on the same batch and random state was clean"
            + (f" ({len(first)} event(s) the first time)" if first else "")
        )
    if not checked:
        return NUMERICS, (
            "reproduced on the same batch and random state: numerics, or a persistent fault; "
            "nothing is checked, so which cannot be told (protect the model, or rerun the "
            "step on other hardware); the update is skipped"
        )
    found = classify(again, step=step, loss=loss, where=here(), config=config)
    if found is not None and found.cause == FAULT:
        return PERSISTENT, (
            f"{VERDICT[FAULT]}: a persistent fault, the checks flag it again in the replay "
            f"({', '.join(found.ops)}); the update is skipped. {found.message}"
        )
    why = found.message if found is not None else "no check disagreed with its operands"
    unknown = found is not None and found.verdict == UNKNOWN
    return NUMERICS, (
        f"reproduced on the same batch and random state with every check consistent: "
        f"{'numerics, or a persistent fault in a GEMM no check sees' if unknown else 'numerics'}"
        f"; the update is skipped. {why}"
    )


class Replayer:
    """The optimizer under ``policy="replay"`` (module docstring); every other attribute is the
    wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, handle: Any = None, *,
                 scaler: Any = None, group: Any = None, replay: bool = True) -> None:  # fmt: skip
        self.optimizer, self.handle, self.scaler, self.group = optimizer, handle, scaler, group
        self.replay = replay  # False: a step that went wrong is skipped at once (skip_step)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.replays = self.transient = self.skipped = 0  # host counts (read with the step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def _flags(self, loss: Any) -> tuple[bool, bool, list]:
        """(protection's flag, the finite test's flag, the drained events): one host read."""
        lost = self.handle.found_inf() if self.handle is not None else None
        bad = nonfinite(self.params, loss)
        flags = torch.stack([bad if lost is None else lost.to(bad.device), bad])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if self.handle is None:
            values, events = flags.tolist(), []
        else:
            events = self.handle.drain(also=flags)
            values = self.handle.read_also
        return values[0] > 0 and self.handle is not None, values[1] > 0, events

    def _apply(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def step(self, closure: Callable[[], Any]) -> Replayed:
        """Run ``closure`` (forward and backward of the step, returning the loss), and apply the
        update, replay the step once, or skip it (module docstring)."""
        rng = RandomState.capture()
        mark = self.handle.mark() if self.handle is not None else None
        loss = closure()
        lost, bad, events = self._flags(loss)
        if not (lost or bad):
            self._apply()
            return Replayed(loss, events=events)
        self.optimizer.zero_grad(set_to_none=True)
        if not self.replay:
            self.skipped += 1
            return Replayed(loss, False, True, events)
        rng.restore()
        if mark is not None:
            self.handle.rewind(mark)
        self.replays += 1
        loss = closure()
        lost_again, bad_again, again = self._flags(loss)
        reproduced = lost_again or bad_again
        value = float(loss.detach().float().sum()) if isinstance(loss, Tensor) else None
        finding, msg = verdict(
            events, again, reproduced=reproduced, checked=self.handle is not None, loss=value,
            config=None if self.handle is None else self.handle.config,
        )  # fmt: skip
        if not reproduced:
            self.transient += 1
            self._apply()
        elif bad_again and not lost_again and self.scaler is not None:
            self._apply()  # an overflow: the scaler skips it and backs its scale off
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
        return Replayed(loss, True, reproduced, events + again, finding, msg)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def replay(optimizer: torch.optim.Optimizer, handle: Any = None, *, scaler: Any = None,
           group: Any = None) -> Replayer:  # fmt: skip
    """``optimizer`` under ``policy="replay"``: :meth:`Replayer.step` takes the step as a
    closure. ``handle``: the :class:`~attnchecker.models.handle.ProtectionHandle` whose
    uncorrectable errors also trigger a replay (None: non-finite losses and gradients only, the
    finite-gradient guard with replay); ``scaler``: a GradScaler that steps the optimizer;
    ``group``: the process group the ranks agree over."""
    return Replayer(optimizer, handle, scaler=scaler, group=group)
