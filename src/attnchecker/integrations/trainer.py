"""``AttnCheckerCallback`` for the Hugging Face ``Trainer``.

Protects the model when training begins (or adopts the protection already on it), drains the
events once per optimizer step just before the step (so ``policy="skip_step"`` can still skip
it: gradients are set to None, which every torch optimizer skips), adds the counters to the
Trainer's logs, and removes the protection it added when training ends.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from attnchecker.attention.config import ABFTConfig

__all__ = ["AttnCheckerCallback"]


class AttnCheckerCallback(TrainerCallback):
    def __init__(self, config: ABFTConfig | None = None) -> None:
        self.config = config
        self.handle = None
        self.events: list[Any] = []
        self.skipped_steps = 0
        self._owned = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from attnchecker.models.protect import protect_

        model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        self.handle = getattr(model, "_attnchecker_handle", None)
        if self.handle is None:
            self.handle = protect_(model, self.config)
            self._owned = True
        self._model = model

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        events = self.handle.drain()
        self.events += events
        if self.handle.skip_requested:
            for p in self._model.parameters():
                p.grad = None
            self.skipped_steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.handle is not None:
            totals = {"detected": 0, "corrected": 0, "uncorrectable": 0}
            for counts in self.handle.counters().values():
                for k in totals:
                    totals[k] += counts[k]
            logs.update({f"attnchecker/{k}": v for k, v in totals.items()})
            logs["attnchecker/skipped_steps"] = self.skipped_steps

    def on_train_end(self, args, state, control, **kwargs):
        from attnchecker.models.protect import unprotect_

        if self._owned:
            unprotect_(self._model)
            self._owned = False
