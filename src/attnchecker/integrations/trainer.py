"""``AttnCheckerCallback`` for the Hugging Face ``Trainer``.

Protects the model when training begins (or adopts the protection already on it) and removes
the protection it added when training ends. Under ``policy="skip_step"`` the Trainer's optimizer
is guarded (:func:`attnchecker.guard`, on the torch optimizer inside accelerate's wrapper): a
step with an uncorrectable error is skipped on the device, every rank alike, and the events are
drained after the step; under fp16 (accelerate's GradScaler) an overflow skips it as well.
Under ``"raise"`` and ``"warn"`` they are drained just before the step, so that ``raise`` stops
training before a bad update. ``"replay"`` is ``"skip_step"`` here, with a warning: a callback
never holds the step's batches, so it cannot recompute them (:func:`attnchecker.replay` in a loop
of one's own, or ``attnchecker train --policy replay``, can).

Every optimizer step is diagnosed (:mod:`attnchecker.recovery.diagnosis`: a computation fault,
your hardware; or numerics, not your hardware) into :attr:`findings`; each log carries the
counters, this run's skipped steps and, per rank (gathered over the process group when there is
one), the computation faults seen (``attnchecker/rank<r>/faults``), with the outlier rank named
(``attnchecker/outlier``).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from attnchecker.attention.config import ABFTConfig

__all__ = ["AttnCheckerCallback"]


def _innermost(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's (or any) ``.optimizer`` wrappers."""
    while getattr(optimizer, "optimizer", optimizer) is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


def _rebind(obj: Any, name: str, value: Any) -> Any:
    """Set the instance attribute ``obj.name``; return what puts the previous one back."""
    if name in vars(obj):
        old = vars(obj)[name]
        setattr(obj, name, value)
        return lambda: setattr(obj, name, old)
    setattr(obj, name, value)
    return lambda: delattr(obj, name)


class AttnCheckerCallback(TrainerCallback):
    def __init__(self, config: ABFTConfig | None = None) -> None:
        self.config = config
        self.handle = None
        self.events: list[Any] = []
        self.findings: list[Any] = []
        self.guarded = None
        self._owned = False
        self._undo = None

    @property
    def skipped_steps(self) -> int:
        """Steps the guard skipped (a device read)."""
        g = self.guarded
        return 0 if g is None or g.skipped is None else int(g.skipped)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from attnchecker.models.protect import protect_
        from attnchecker.recovery.diagnosis import RankCounts, here

        model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        self.handle = getattr(model, "_attnchecker_handle", None)
        if self.handle is None:
            self.handle = protect_(model, self.config)
            self._owned = True
        self._model = model
        where = here(next(model.parameters()).device)
        self._where, self._counts = where, RankCounts(where.rank, where.host, where.device)
        if self.handle.config.policy == "replay":
            import warnings

            warnings.warn(
                "attnchecker: policy='replay' skips the step under the Trainer (a callback does "
                "not hold the batches to replay them); attnchecker.replay does in a loop of "
                "one's own",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.handle.config.policy in ("skip_step", "replay") and optimizer is not None:
            self._guard(optimizer)

    def _guard(self, optimizer: Any) -> None:
        """Route the torch optimizer's ``step`` through the guard (instance attributes, put back
        at the end)."""
        from attnchecker.recovery.guard import guard

        opt = _innermost(optimizer)
        self.guarded = guard(opt, self.handle)  # keeps opt.step as bound now

        def step(closure=None):
            return self.guarded.step(closure)

        undo = [_rebind(opt, "step", step)]
        # Under a GradScaler (fp16) accelerate sets opt.step, at every step, to a patch of the
        # step it saw when it wrapped the optimizer (before any callback ran), then back: the
        # guard would be bypassed. Point both of its copies at the guarded step.
        wrapper = optimizer
        while wrapper is not opt:
            if hasattr(wrapper, "_optimizer_patched_step_method"):
                from accelerate.optimizer import patch_optimizer_step

                patched = patch_optimizer_step(wrapper, step)  # records that the step was called
                undo.append(_rebind(wrapper, "_optimizer_original_step_method", step))
                undo.append(_rebind(wrapper, "_optimizer_patched_step_method", patched))
            wrapper = wrapper.optimizer

        def restore() -> None:
            for fn in reversed(undo):
                fn()

        self._undo = restore

    def _drain(self, state) -> None:
        from attnchecker.recovery.diagnosis import classify, tally

        events = self.handle.drain()
        self.events += events
        finding = classify(
            events, step=state.global_step + 1, where=self._where, config=self.handle.config
        )
        tally(self._counts, events, finding)
        if finding is not None:
            self.findings.append(finding)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guarded is None:
            self._drain(state)
            if self.handle.skip_requested:  # skip_step without an optimizer to guard
                for p in self._model.parameters():
                    p.grad = None

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.guarded is not None:  # after the guarded step: found_inf was read on the device
            self._drain(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        from attnchecker.recovery.diagnosis import gather, outliers

        if logs is None or self.handle is None:
            return
        totals = {"detected": 0, "corrected": 0, "uncorrectable": 0}
        for counts in self.handle.counters().values():
            for k in totals:
                totals[k] += counts[k]
        logs.update({f"attnchecker/{k}": v for k, v in totals.items()})
        logs["attnchecker/skipped_steps"] = self.skipped_steps
        logs["attnchecker/numerics_steps"] = self._counts.numerics
        ranks = gather(self._counts)  # on_log runs on every rank
        logs.update({f"attnchecker/rank{r.rank}/faults": r.faults for r in ranks})
        named = outliers(ranks)
        if named:
            logs["attnchecker/outlier"] = "; ".join(named)

    def on_train_end(self, args, state, control, **kwargs):
        from attnchecker.models.protect import unprotect_

        if self._undo is not None:
            self._undo()
            self._undo = None
        if self._owned:
            unprotect_(self._model)
            self._owned = False
