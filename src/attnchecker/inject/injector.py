"""``Injector(model, plan)``: put a plan's faults into a model while it trains, then leave no trace.

Attention sites go through the named sites of protected attention: on a protected model the
faults land between each operation and its check; on a plain model the injector instruments it
(``protect_`` with no checks) for the duration, so protected and unprotected runs meet the very
same faults. Linear sites (``linear:<role>:<op>``) likewise, through the protected linear layer
or one the injector instruments for the duration. Module outputs, gradients and optimizer
state are reached with ordinary hooks. Every fault fires at most once, never during a
gradient-checkpointing replay, and every hook is removed on exit, even when the body raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import Tensor, nn

from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.state import SiteCall, in_replay
from attnchecker.errors import ConfigError
from attnchecker.inject.kinds import apply_kind, kernel_edit
from attnchecker.inject.plan import Fault, FaultPlan
from attnchecker.models.registry import linear_by_role, linear_layers, role_of

__all__ = ["FaultRecord", "Injector"]

_SHOWN = 16  # values kept per record


@dataclass(frozen=True)
class FaultRecord:
    """One fired fault: where, when, and the values before and after (the first 16)."""

    fault: int  # index in the plan
    site: str
    layer: int | None
    step: int
    index: str
    n_elements: int
    old: list[float]
    new: list[float]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _first_tensor(output: object) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    values = (
        output.values()
        if isinstance(output, dict)
        else output
        if isinstance(output, tuple | list)
        else ()
    )
    return next((v for v in values if isinstance(v, Tensor)), None)


class Injector:
    """Context manager that fires ``plan``'s faults in ``model`` (and ``optimizer`` for
    ``optim:`` sites). ``records`` lists the fired faults, ``unfired`` the others."""

    def __init__(
        self,
        model: nn.Module,
        plan: FaultPlan,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        step_fn: Callable[[], int] | None = None,
    ):
        self.model, self.plan, self.optimizer = model, plan, optimizer
        self._step_fn = step_fn  # a training loop's own step (replays after a rollback repeat it)
        self.records: list[FaultRecord] = []
        self.step = 0
        self._fired: set[int] = set()
        self._fired_in: dict[int, int] = {}  # the forward pass a fault last fired in
        self._undo: list[Callable[[], None]] = []

    @property
    def unfired(self) -> list[Fault]:
        return [f for i, f in enumerate(self.plan.faults) if i not in self._fired]

    def __enter__(self) -> Injector:
        try:
            self._install()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _install(self) -> None:
        from attnchecker.models.protect import protect_, unprotect_

        # Its own count of forward passes, not the protected model's clock (handle.step): a
        # plan's steps count from entering the injector (the clock, from protect_), faults at
        # module / grad / optim sites fire in plain models, which have no clock, and the clock
        # is a device tensor, which every site would have to read (a host sync each time).
        def tick(*_: object) -> None:
            self.step += 1

        self._undo.append(self.model.register_forward_pre_hook(tick).remove)
        faults = list(enumerate(self.plan.faults))
        handle = getattr(self.model, "_attnchecker_handle", None)
        if any(f.family in ("attention", "linear") for _, f in faults):
            if handle is None:
                handle = protect_(self.model, ABFTConfig(ops=()))  # the sites, nothing checked
                self._undo.append(lambda: unprotect_(self.model))
            self._undo.append(handle.attach(self._on_site).remove)  # every protected module's
        if any(f.family == "kernel" for _, f in faults):
            self._install_kernel()
        if any(f.family == "linear" for _, f in faults):
            self._install_linear(handle, [f for _, f in faults if f.family == "linear"])
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names too
        for i, f in faults:
            if f.family == "module":
                module = self.model.get_submodule(f.site.split(":", 1)[1])
                self._undo.append(module.register_forward_hook(
                    partial(self._on_module, i), prepend=True).remove)  # before any check
            elif f.family == "grad":
                name = f.site.split(":", 1)[1]
                if name not in params:
                    raise ConfigError(f"no parameter {name!r} in the model")
                self._undo.append(params[name].register_hook(partial(self._on_grad, i)).remove)
            elif f.family == "optim":
                if self.optimizer is None:
                    raise ConfigError(f"fault at {f.site!r} needs Injector(..., optimizer=...)")
                name, key, when = _optim_site(f.site)
                if name not in params:
                    raise ConfigError(f"no parameter {name!r} in the model")
                hook = partial(self._on_optimizer, i, params[name], key)
                register = (self.optimizer.register_step_pre_hook if when == "before"
                            else self.optimizer.register_step_post_hook)  # fmt: skip
                self._undo.append(register(hook).remove)

    def _install_linear(self, handle, faults: list[Fault]) -> None:
        """Linear sites: the named linear layers' sites, between each GEMM and its check. A
        layer the protected model checks already has them; any other is instrumented for the
        injector's lifetime with a state that checks nothing (the same sites, unchecked). An
        attention projection is refused (its sites are q, k, v, out)."""
        from attnchecker.attention.projection import protect_linears
        from attnchecker.attention.schedule import Schedule
        from attnchecker.attention.state import Clock

        states = {n: handle.state(n) for n in handle.modules}
        wanted = {(f.layer, f.site.split(":")[1]) for f in faults}
        linears = linear_by_role(self.model, {role for _, role in wanted})
        if missing := sorted(wanted - set(linears)):
            raise ConfigError(
                f"no linear layer {missing} (layer, role) in the model; its roles: "
                f"{sorted({r for *_, r in linear_layers(self.model)})}"
            )
        for key in sorted(wanted):
            name, m = linears[key]
            if any(name.startswith(a + ".") for a, st in states.items() if "y" not in st.hooks):
                raise ConfigError(f"{name} is in attention: fault its projections at q/k/v/out")
            if name in states:
                continue  # checked by the protected model: attached with its other sites
            p = next(m.parameters())
            clock = Clock(torch.zeros(1, dtype=torch.float64, device=p.device))
            made, undo, _ = protect_linears([(name, m, *key)], ABFTConfig(ops=()), clock,
                                            Schedule((), entries=()))  # fmt: skip
            self._undo += undo
            for hooks in made[name].sites.hooks.values():
                hooks.append(self._on_site)  # gone with the state when undone

    def _install_kernel(self) -> None:
        """Kernel sites: every fused state asks the injector, at each attention call, for the
        fault to inject (coordinates drawn from the operands' shapes)."""
        handle = getattr(self.model, "_attnchecker_handle", None)
        states = [] if handle is None else [handle.state(n) for n in handle.modules]
        states = [st for st in states if st.kernel is not None]
        if not states:
            raise ConfigError(
                "kernel sites need a model protected with ABFTConfig(backend='triton') "
                "(ops=() for the unchecked arm)"
            )
        for st in states:
            previous = st.kernel_fault
            st.kernel_fault = partial(self._on_kernel, st)
            self._undo.append(partial(setattr, st, "kernel_fault", previous))

    def _on_kernel(self, state, query: Tensor, key: Tensor):
        """The KernelFault of a due kernel fault of this layer, or None."""
        from attnchecker.kernels.flash import KernelFault

        for i, f in enumerate(self.plan.faults):
            if f.family != "kernel" or f.layer != state.layer or not self._due(i, f):
                continue
            site = f.site.split(":", 1)[1]
            g = self.plan.generator(i)

            def draw(n: int, given: int | None, g=g) -> int:
                return int(torch.randint(0, n, (1,), generator=g)) if given is None else given

            B, H, L, d = query.shape
            Lk = key.shape[-2]
            rows, cols = {"pv": (L, d), "dq": (L, d), "dv": (Lk, d), "dk": (Lk, d)}.get(
                site, (L, Lk)
            )
            b, h = draw(B, f.batch), draw(H, f.head)
            row, col = draw(rows, f.row), draw(cols, f.col)
            row = -1 if f.pattern == "1C" else row
            col = -1 if f.pattern == "1R" else col
            mode, value = kernel_edit(f.kind, value=f.value, generator=g)
            self._fired.add(i)
            self._fired_in[i] = self.step
            self.records.append(
                FaultRecord(i, f.site, state.layer, self.current_step,
                            _describe((b, h, slice(None) if row < 0 else row,
                                       slice(None) if col < 0 else col)),
                            (rows if row < 0 else 1) * (cols if col < 0 else 1), [], [value])
            )  # fmt: skip
            return KernelFault(site, b, h, row, col, value, f.persistent, mode, f.bit or 0)
        return None

    @property
    def current_step(self) -> int:
        """The loop's step when it gave ``step_fn``, else the number of forward passes so far."""
        return self.step if self._step_fn is None else self._step_fn()

    def _due(self, i: int, fault: Fault, replay: bool | None = None) -> bool:
        """Not fired yet (a persistent fault: not in this forward pass and its backward, so that
        a training step replayed on its batch meets it again), this step, and not a
        checkpointing replay (``replay``: as the site says; a backward site runs inside autograd
        but is never a replay)."""
        replay = in_replay() if replay is None else replay
        fresh = self._fired_in.get(i) != self.step if fault.persistent else i not in self._fired
        return fresh and fault.step == self.current_step and not replay

    def _fire(self, i: int, t: Tensor, layer: int | None) -> None:
        fault = self.plan.faults[i]
        index = fault.index(t.shape, self.plan.generator(i))
        old, new = apply_kind(
            fault.kind, t, index, bit=fault.bit, value=fault.value, generator=self.plan.generator(i)
        )
        self._fired.add(i)
        self._fired_in[i] = self.step
        flat_old, flat_new = old.reshape(-1), new.reshape(-1)
        self.records.append(
            FaultRecord(
                i, fault.site, layer, self.current_step, _describe(index), flat_old.numel(),
                flat_old[:_SHOWN].double().tolist(), flat_new[:_SHOWN].double().tolist(),
            )
        )  # fmt: skip

    def _on_site(self, call: SiteCall) -> None:
        for i, f in enumerate(self.plan.faults):
            if f.family == "linear":
                _, role, op = f.site.split(":")
                hit = op == call.site and f.layer == call.layer and role_of(call.module) == role
            else:
                hit = f.family == "attention" and f.site == call.site and f.layer == call.layer
            if hit and self._due(i, f, call.replay):
                self._fire(i, call.tensor, call.layer)

    def _on_module(self, i: int, module: nn.Module, args: object, output: object) -> None:
        t = _first_tensor(output)
        if t is not None and self._due(i, self.plan.faults[i]):
            self._fire(i, t.data, None)

    def _on_grad(self, i: int, grad: Tensor) -> Tensor | None:
        # Backward runs inside an autograd node: check the step only (no replay test).
        if not self._due(i, self.plan.faults[i], replay=False):
            return None
        grad = grad.clone()
        self._fire(i, grad, None)
        return grad

    def _on_optimizer(self, i: int, param: Tensor, key: str, *_: object) -> None:
        state = self.optimizer.state.get(param, {})
        target = param if key == "param" else state.get(key)
        if self._due(i, self.plan.faults[i], replay=False) and isinstance(target, Tensor):
            local = target.to_local() if hasattr(target, "to_local") else target
            self._fire(i, local.data, None)


def _optim_site(site: str) -> tuple[str, str, str]:
    """``(parameter, state key or "param", "before" | "written")`` of an ``optim:`` site."""
    parts = site.split(":")
    when = parts[3] if len(parts) > 3 else "before"
    return parts[1], parts[2], when


def _describe(index: tuple) -> str:
    def one(x: object) -> str:
        if isinstance(x, slice):
            return ":" if x.start is None and x.stop is None else f"{x.start}:{x.stop}"
        if isinstance(x, Tensor):
            return "[" + ",".join(str(v) for v in x.tolist()) + "]"
        return str(x)

    return "(" + ", ".join(one(x) for x in index) + ")"
