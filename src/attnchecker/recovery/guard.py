"""``guard(optimizer, handle)``: an optimizer whose update is skipped, on the device, in a step
where protection recorded an uncorrectable error.

    opt = attnchecker.guard(torch.optim.AdamW(model.parameters(), fused=True), handle)
    loss.backward(); opt.step(); opt.zero_grad(); handle.drain()

The flag is :meth:`~attnchecker.models.handle.ProtectionHandle.found_inf` (the eager engine's
logs and the fused kernels' counters, read without a host synchronisation), max-reduced over the
process group when ``torch.distributed`` is initialised, so every rank skips together.

- **Fused** Adam, AdamW and SGD (``fused=True``) take it as their ``found_inf`` (GradScaler's
  mechanism): the kernels leave parameters, moments and the step count untouched.
- **Any other optimizer**: a masked update. Parameters and optimizer state are kept, the step
  runs, and ``torch.where(flag, kept, updated)`` restores them where the flag is set: exact,
  at the cost of one copy of parameters and state per step. State an optimizer creates in its
  first step (momentum buffers, Adam's moments) cannot be masked to "absent": on a parameter's
  first step the flag is read once (one host sync, then never again) and a flagged step is not
  taken. Step counters that live on the CPU (non-fused, non-capturable Adam on CUDA) are
  restored the same way, which costs a device-to-host read: prefer ``fused=True``.

Fused SGD with momentum reads the flag on a parameter's first step too: it allocates the
momentum buffer uninitialised and relies on the step to fill it, so a skipped first step would
leave garbage for the next one. Fused Adam / AdamW never read it (a skipped first step leaves
zero moments and a zero step count: the next step is a first step, exactly).

Under ``torch.amp.GradScaler`` (``scaler.step(opt)``, with ``opt`` the guard itself or an
optimizer whose ``step`` routes through it) either flag skips the step:

- a fused optimizer is stepped with ``found_inf = max(scaler's, protection's)``. GradScaler sets
  ``grad_scale`` and ``found_inf`` on the object it is handed; on the guard both are forwarded
  to the wrapped optimizer, whose kernels read them from itself (``grad_scale`` unscales the
  gradients in the kernel), so no host synchronisation is added.
- any other optimizer: GradScaler unscales, checks for an overflow on the host and calls
  ``step`` only without one, so the guard sees only the steps it has to mask.

``skipped`` counts, on the device, the steps protection's flag skipped (an overflow the scaler
skipped on its own is the scaler's to count: its scale backs off).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["FiniteGradients", "GuardedOptimizer", "guard", "nonfinite"]

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _forwarded(name: str) -> property:
    """An attribute read, set and deleted on the wrapped optimizer: GradScaler.step sets
    ``grad_scale`` and ``found_inf`` on the object it is handed and deletes them after the step,
    while a fused optimizer reads them from itself."""
    return property(
        lambda self: getattr(self.optimizer, name),
        lambda self, value: setattr(self.optimizer, name, value),
        lambda self: delattr(self.optimizer, name),
    )


class GuardedOptimizer:
    """Wraps an optimizer; every other attribute is the wrapped optimizer's."""

    grad_scale = _forwarded("grad_scale")
    found_inf = _forwarded("found_inf")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        handle: Any,
        *,
        group: Any = None,
        check_update: bool | None = None,
        names: dict[int, str] | None = None,
    ):
        self.optimizer = optimizer
        self._step = optimizer.step  # as bound now (an integration may reroute optimizer.step)
        self.handle = handle
        self.group = group
        self.skipped: Tensor | None = None  # device counter, created at the first step
        self.fused = isinstance(optimizer, _FUSED) and all(
            g.get("fused") for g in optimizer.param_groups
        )
        # the update check (ABFTConfig(invariants=("update",)), or asked for here), read with
        # the handle's drain
        config = getattr(handle, "config", None)
        if check_update is None:
            check_update = config is not None and "update" in config.invariants
        self.update = None
        if check_update:
            from attnchecker.recovery.update_check import UpdateCheck

            scale = config.tolerance_scale if config is not None else 1.0
            kernels = config is not None and config.check_impl == "triton"
            self.update = UpdateCheck(optimizer, names=names, scale=scale, kernels=kernels)
            if hasattr(handle, "invariants"):
                handle.invariants.append(self.update)
        # whose first step leaves state a skipped step must not (see the module docstring)
        self._reads_first = not self.fused or (
            isinstance(optimizer, torch.optim.SGD)
            and any(g.get("momentum", 0) for g in optimizer.param_groups)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def flag(self) -> Tensor:
        """1.0 where this step must be skipped (on every rank alike), as a device tensor."""
        return self._on_every_rank(self.handle.found_inf())

    def _on_every_rank(self, flag: Tensor) -> Tensor:
        """``flag`` max-reduced over the process group (when there is one): every rank alike."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return flag

    def _with_scaler(self, flag: Tensor) -> Tensor:
        """``flag`` widened with GradScaler's ``found_inf`` when it drives this step: an
        overflow or an uncorrectable error skips the step, on the device (no host read)."""
        theirs = getattr(self.optimizer, "found_inf", None)
        return flag if theirs is None else torch.maximum(theirs, flag.to(theirs.device))

    def step(self, closure: Any = None, *, flag: Tensor | None = None) -> Any:
        """The optimizer's step, skipped where the flag (:meth:`flag`, or the one given, already
        reduced) is set."""
        flag = self.flag() if flag is None else flag
        if self.update is not None and self.update.can_fuse():  # the step in the checked kernel
            both = self._with_scaler(flag)
            self.skipped = both.clone() if self.skipped is None else self.skipped.add_(both)
            # through torch.optim's step wrapper: its step hooks run as for any step (the
            # protected model's clock learns that the weights moved; an injector's optim: sites)
            update = self.update
            step = torch.optim.Optimizer.profile_hook_step(lambda _opt: update.fused_step(both))
            step(self.optimizer)
            self.update.after(both)
            return None
        rest = self.update.before() if self.update is not None else None
        if rest is not None:  # a parameter changed at rest under L2 decay: skip, then repair
            flag = torch.maximum(flag, self._on_every_rank(rest).to(flag.device))
        self.skipped = flag.clone() if self.skipped is None else self.skipped.add_(flag)
        if self._reads_first and self._first_step() and bool(flag):  # one read, then never
            return None  # the state a first step creates cannot be masked to "absent"
        if self.fused:
            taken = self._with_scaler(flag)  # GradScaler's overflow skips it too
            out = self._fused_step(taken, closure)
        else:
            taken, out = flag, self._masked_step(flag, closure)
        if self.update is not None:
            self.update.after(taken)
        return out

    def settle(self) -> list[dict[str, object]]:
        """Without a handle's drain (``guard(opt, FiniteGradients(...), check_update=True)``):
        read the update check's counts (one host transfer), repair what they flag, and return
        its events."""
        if self.update is None or not self.update.pending:
            return []
        return self.update.events(self.update.tensor().tolist(), -1)

    def _fused_step(self, both: Tensor, closure: Any) -> Any:
        """A fused optimizer's step with ``found_inf`` = ``both`` (protection's flag widened
        with GradScaler's: :meth:`_with_scaler`), the scaler's own put back after."""
        opt = self.optimizer
        theirs = getattr(opt, "found_inf", None)  # GradScaler's, when it drives this step
        opt.found_inf = both
        try:
            return self._step(closure)
        finally:
            if theirs is None:
                del opt.found_inf
            else:  # the scaler deletes its own after the step
                opt.found_inf = theirs

    def _first_step(self) -> bool:
        """Whether a parameter with a gradient has no optimizer state yet: its first step
        creates state (momentum buffers, moments; fused SGD allocates its buffer uninitialised
        and relies on the step to fill it) that a skipped step must not leave behind."""
        opt = self.optimizer
        return any(
            not opt.state.get(p)
            for g in opt.param_groups
            for p in g["params"]
            if p.grad is not None
        )

    def _masked_step(self, flag: Tensor, closure: Any) -> Any:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        kept = [p.detach().clone() for p in params]
        kept_state = [
            {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, Tensor)} for p in params
        ]
        out = self._step(closure)
        skip = flag > 0
        with torch.no_grad():
            for p, old, state in zip(params, kept, kept_state, strict=True):
                p.copy_(torch.where(skip, old, p))
                for key, old_v in state.items():
                    new = opt.state[p][key]
                    new.copy_(torch.where(skip.to(new.device), old_v, new))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class FiniteGradients:
    """The flag of :func:`guard` without ABFT: 1.0 when a gradient of ``params`` is not finite
    (GradScaler's test, without the scaling), computed on the device. What a user has without
    protection, ``guard(opt, FiniteGradients(model.parameters()))``: an update that would put a
    NaN or INF into the weights is skipped, nothing is corrected."""

    def __init__(self, params: Any) -> None:
        self.params = [p for p in params if p.requires_grad]

    def found_inf(self) -> Tensor:
        return nonfinite(self.params)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): this rank's shard


def nonfinite(params: Any, loss: Any = None) -> Tensor:
    """1.0 on the device when the loss or a gradient of ``params`` is not finite, else 0.0 (no
    host read): the finite-gradient guard's test (a norm that overflows counts: GradScaler tests
    elements, ``clip_grad_norm_`` the norm)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    parts = [torch.stack(torch._foreach_norm(grads)).sum()] if grads else []
    if isinstance(loss, Tensor):
        parts.append(loss.detach().float().sum().to(parts[0].device if parts else loss.device))
    if not parts:
        return torch.zeros(())
    return (~torch.isfinite(torch.stack(parts).sum())).to(torch.float32)


def guard(
    optimizer: torch.optim.Optimizer,
    handle: Any,
    *,
    group: Any = None,
    check_update: bool | None = None,
    names: Any = None,
) -> GuardedOptimizer:
    """``optimizer``, skipping its update on the device in a step where ``handle`` (a
    :class:`~attnchecker.models.handle.ProtectionHandle`) recorded an uncorrectable error.
    ``check_update`` (default: ``"update"`` in the handle's ``ABFTConfig.invariants``) checks
    every update too (:mod:`attnchecker.recovery.update_check`); ``names`` (the model, or a
    dict from ``id(parameter)`` to a name) names the parameters in its events."""
    if isinstance(names, torch.nn.Module):  # a model: its parameters' names
        names = {id(p): n for n, p in names.named_parameters()}
    return GuardedOptimizer(optimizer, handle, group=group, check_update=check_update,
                            names=names)  # fmt: skip
