"""``protect_`` and ``unprotect_``: one call to check a model's attention, one to undo it.

Protection wraps, it does not copy: forward hooks on the projection submodules check and repair
their outputs, and the attention core is routed through :func:`attnchecker.attention.core.attend`.
No parameter, buffer or module is added or replaced, so ``state_dict()`` is unchanged and
``unprotect_`` restores the model exactly.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnchecker.attention.checks import Projection, projection_check_, row_factor, row_floor
from attnchecker.attention.config import GRAD_OPS, LINEAR_OPS, ABFTConfig
from attnchecker.attention.core import CORE
from attnchecker.attention.grads import CORE_GRAD_OPS, checked_linear, new_records_sink
from attnchecker.attention.state import AttentionState, Clock, _ranged, new_log
from attnchecker.errors import ConfigError, NoMatchingModuleError, UnsupportedModelError
from attnchecker.models.handle import ProtectionHandle
from attnchecker.models.registry import ProjectionSpec, _is_conv1d, discover, install

__all__ = ["protect_", "unprotect_"]

_HANDLE = "_attnchecker_handle"


def _projection(spec: ProjectionSpec) -> Projection:
    m = spec.module
    return Projection(
        m.weight, m.bias, spec.conv1d, spec.sites, spec.groups, spec.site_groups, spec.interleaved
    )


def _projection_hook(state: AttentionState, spec: ProjectionSpec) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Tensor, ...], y: Tensor) -> None:
        proj, start = _projection(spec), 0
        if spec.interleaved:  # (..., heads, sites, d): a site is a strided slice, edited as a copy
            parts = y.unflatten(-1, (spec.groups // len(spec.sites), len(spec.sites), -1))
            for i, site in enumerate(spec.sites):
                if state.hooks[site]:
                    part = parts[..., i, :]
                    edited = part.flatten(-2)  # (..., heads * d)
                    state.site(site, edited)
                    part.data.copy_(edited.unflatten(-1, part.shape[-2:]))
        else:
            for site, width in zip(spec.sites, proj.site_widths(y.shape[-1]), strict=True):
                state.site(site, y[..., start : start + width])
                start += width
        if any(state.checks(s) for s in spec.sites):  # read per call: a schedule switches it
            state.defer(proj, args[0], y, last=spec.last)

    return hook


def _patch_backward(
    module: nn.Module, conv1d: bool, state: AttentionState, dx: str, dw: str
) -> Callable[[], None] | None:
    """Route a Linear / Conv1D's forward through :func:`checked_linear`, whose backward checks
    dX (op ``dx``) and dW (op ``dw``) where the config checks them, and runs their sites either
    way; returns the undo, or None for a module of another kind (its forward is left alone)."""
    from transformers.pytorch_utils import Conv1D

    kind = Conv1D if conv1d else nn.Linear
    if type(module).forward is not kind.forward or "forward" in vars(module):
        return None
    ops = ((state.grad_ops.index(dx), dx), (state.grad_ops.index(dw), dw))
    config = state.config

    def forward(x: Tensor) -> Tensor:
        hook = state.grad_hook()
        check = (state.checks(dx), state.checks(dw))  # per call: a schedule switches them
        if state.grads is None or not torch.is_grad_enabled() or not (any(check) or hook):
            return kind.forward(module, x)
        return checked_linear(
            x, module.weight, module.bias, state.grads, state.clock.count, ops=ops, check=check,
            conv1d=conv1d, max_rows=config.max_rows, scale=config.tolerance_scale, hook=hook,
            impl=config.check_impl,
        )  # fmt: skip

    module.forward = forward
    return lambda: delattr(module, "forward")


def _linear_hook(state: AttentionState, conv1d: bool) -> Callable[..., None]:
    """Check a linear layer's output like a projection of one head group (``scope="all_linear"``):
    rows (tokens) against x . sum_o W_o + sum_o b_o, columns by range, repaired in place."""

    def hook(module: nn.Module, args: tuple[Tensor, ...], y: Tensor) -> None:
        state.site("y", y)
        x = args[0]
        if not state.checks("y") or x.dim() < 2 or not y.is_contiguous():
            return
        x3, y3 = x.reshape(1, -1, x.shape[-1]), y.view(1, -1, y.shape[-1])  # (1, T, K), (1, T, N)
        item = [(Projection(module.weight, module.bias, conv1d, ("y",), 1), y3)]
        factor = row_factor(x3, item, state.config.tolerance_scale)
        with _ranged(f"linear.{state.name}"):
            rec = projection_check_(
                x3, item, max_rows=state.config.max_rows, factor=factor,
                floor=row_floor(item) / factor,
                impl=state.config.check_impl,
            )[0]  # fmt: skip
        state.note(("y",), rec)
        state.commit()

    return hook


def _protect_linears(
    model: nn.Module, handle: ProtectionHandle, taken: set[int], config: ABFTConfig, clock: Clock
) -> list[str]:
    """``scope="all_linear"``: every Linear / Conv1D outside the protected attention modules
    gets a state of its own (ops ``y``, ``dx``, ``dw``: :data:`LINEAR_OPS`); returns the names
    of those whose backward could not be checked (a forward of their own)."""
    unpatched = []
    LINEAR_GRAD_OPS = LINEAR_OPS[1:]
    backward = any(op in config.ops for op in GRAD_OPS)
    checked = frozenset(("y", *(LINEAR_GRAD_OPS if backward else ())))
    for name, m in model.named_modules():
        conv1d = _is_conv1d(m)
        if id(m) in taken or not (isinstance(m, nn.Linear) or conv1d):
            continue
        dev = _device(m, clock.count.device)
        layer = next((int(part) for part in name.split(".") if part.isdigit()), -1)
        st = AttentionState(
            name, layer, config, clock, new_log(dev, 1), ops=("y",),
            grad_ops=LINEAR_GRAD_OPS, checked=checked,
        )  # fmt: skip
        st.grads = new_records_sink(len(LINEAR_GRAD_OPS), dev)
        handle._states[name] = st
        handle._undo.append(m.register_forward_hook(_linear_hook(st, conv1d)).remove)
        undo = _patch_backward(m, conv1d, st, *LINEAR_GRAD_OPS)
        if undo is not None:
            handle._undo.append(undo)
        else:
            st.hooks = {"y": st.hooks["y"]}
            st.checked = frozenset(("y",))
            if backward:
                unpatched.append(name)
                st.coverage.unwired.extend(LINEAR_GRAD_OPS)
    return unpatched


def protect_(model: nn.Module, config: ABFTConfig | None = None) -> ProtectionHandle:
    """Protect every attention layer of a supported Hugging Face model in place.

    Raises :class:`~attnchecker.errors.UnsupportedModelError` for an unknown family and
    :class:`~attnchecker.errors.NoMatchingModuleError` when ``config.layers`` selects nothing.
    """
    config = ABFTConfig() if config is None else config
    if not isinstance(config, ABFTConfig):
        raise ConfigError(f"config must be an ABFTConfig, got {type(config).__name__}")
    if getattr(model, _HANDLE, None) is not None:
        raise ConfigError(
            "the model is already protected; call attnchecker.unprotect_(model) first"
        )
    found = discover(model)
    blocks = found.blocks
    layers = config.layers  # a schedule wires every layer: its sites stay addressable
    chosen = [b for b in blocks if layers is None or b.layer in layers]
    if not chosen:
        raise NoMatchingModuleError(
            f"layers={layers} selects none of the {len(blocks)} attention layers "
            f"(indices {sorted(b.layer for b in blocks)})"
        )
    if config.schedule is not None:
        have = {b.layer for b in blocks}
        if missing := sorted({layer for layer, _, _ in config.schedule} - have):
            raise NoMatchingModuleError(
                f"the schedule names layers {missing}; the model's attention layers are "
                f"{sorted(have)}"
            )
    device = _device(model)
    fused = _fused(config, found, device)
    clock = Clock(torch.zeros(1, dtype=torch.float64, device=device))
    naive = dataclasses.replace(config, mode="naive")  # where V's sums may not be passed
    states = {
        b.name: AttentionState(
            b.name, b.layer, config if b.passing else naive, clock, new_log(_device(b.core, device))
        )
        for b in chosen
    }
    if fused:
        from attnchecker.kernels.flash import new_counts
        from attnchecker.kernels.ops import new_sink

        for b in chosen:
            states[b.name].kernel = new_counts(_device(b.core, device))
            states[b.name].kernel_sink = new_sink(_device(b.core, device))
    if config.schedule is not None:
        for st in states.values():  # step 1 runs every check of the schedule
            st.phases = (config.layer_ops(st.layer, step=2), config.layer_ops(st.layer))
            st.checked = st.phases[1]
    engine, note = ("triton", "") if fused else ("eager", _eager_note(config, device))
    for st in states.values():
        st.coverage.engine, st.coverage.note = engine, note
    handle = ProtectionHandle(config, states, clock)
    names = {id(m): n for n, m in model.named_modules()}
    unpatched: list[str] = []  # Linear / Conv1D whose own forward replaced: no backward checks
    for b in blocks:
        setattr(b.core, CORE, (b.spec, states.get(b.name)))
    handle._undo.append(lambda: [delattr(b.core, CORE) for b in blocks])
    for b in chosen:
        st = states[b.name]
        st.grads = new_records_sink(len(st.grad_ops), _device(b.core, device))
        wired = {*st.ops, *(() if fused else CORE_GRAD_OPS)}  # the sites this module has
        for p in b.projections:
            handle._undo.append(p.module.register_forward_hook(_projection_hook(st, p)).remove)
            ops = (f"dx.{p.sites[0]}", f"dw.{p.sites[0]}")
            undo = _patch_backward(p.module, p.conv1d, st, *ops)
            if undo is not None:
                handle._undo.append(undo)
                wired.update(ops)
            elif any(op in config.ops for op in ops) or config.schedule is not None:
                unpatched.append(names.get(id(p.module), "?"))
                st.coverage.unwired.extend(ops)
        st.hooks = {s: hooks for s, hooks in st.hooks.items() if s in wired}
    if config.scope == "all_linear":
        taken = {id(p.module) for b in chosen for p in b.projections}
        unpatched += _protect_linears(model, handle, taken, config, clock)
    if unpatched:
        warnings.warn(
            f"attnchecker: {len(unpatched)} linear layer(s) have a forward of their own (a "
            f"subclass, a quantized layer, or a hook that replaced forward, e.g. accelerate's): "
            f"their backward GEMMs (dx, dw) are not checked: {', '.join(unpatched)}; "
            f"handle.summary()['per_module'] lists what is checked where",
            RuntimeWarning,
            stacklevel=2,
        )
    handle._undo.append(install(model, found, fused=fused))

    def tick(module: nn.Module, *_: object) -> None:
        clock.tick(_device(module, clock.count.device))

    handle._undo.append(model.register_forward_pre_hook(tick).remove)
    setattr(model, _HANDLE, handle)
    handle._undo.append(lambda: delattr(model, _HANDLE))
    return handle


def _eager_note(config: ABFTConfig, device: torch.device) -> str:
    """Why the eager engine runs where the config allowed the fused kernels ("" if asked)."""
    if config.backend != "auto":
        return ""
    from attnchecker import kernels

    if device.type != "cuda":
        return (
            f"backend='auto' chose eager: the model was on {device} at protect_ (protect it "
            f"after moving it to CUDA for the fused kernels)"
        )
    if not kernels.available():
        return "backend='auto' chose eager: triton is not available"
    return "backend='auto' chose eager: the fused kernels do not cover this model or failed"


def _fused(config: ABFTConfig, found, device: torch.device) -> bool:
    """Whether the fused kernels run the attention core (``config.backend``)."""
    from attnchecker import kernels

    if config.backend == "eager":
        return False
    usable = kernels.available() and not found.wiring.patch
    if config.backend == "auto":
        if not (usable and device.type == "cuda"):
            return False
        reason = kernels.self_test(device)
        if reason is not None:
            warnings.warn(
                f"backend='auto': the fused kernels failed their self-test on {device} "
                f"({reason}); the checked eager attention runs instead",
                RuntimeWarning,
                stacklevel=3,
            )
        return reason is None
    if not kernels.available():
        raise ConfigError(
            "backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU, "
            "tests only); use backend='eager' or 'auto'"
        )
    if found.wiring.patch:
        raise UnsupportedModelError(
            f"backend='triton': {found.model_type} does not dispatch through transformers' "
            f"attention interface; use backend='eager' or 'auto'"
        )
    return True


def _device(module: nn.Module, default: torch.device | None = None) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else (default or torch.device("cpu"))


def unprotect_(model: nn.Module) -> None:
    """Remove protection: hooks, patches and attributes; the model is as it was."""
    handle = getattr(model, _HANDLE, None)
    if handle is None:
        raise ConfigError("the model is not protected")
    handle._remove()
