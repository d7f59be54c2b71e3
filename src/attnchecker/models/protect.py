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

from attnchecker.attention.checks import Projection
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.state import AttentionState, Clock, new_log
from attnchecker.errors import ConfigError, NoMatchingModuleError, UnsupportedModelError
from attnchecker.models.handle import ProtectionHandle
from attnchecker.models.registry import CORE, ProjectionSpec, discover, install

__all__ = ["protect_", "unprotect_"]

_HANDLE = "_attnchecker_handle"


def _projection(spec: ProjectionSpec) -> Projection:
    m = spec.module
    return Projection(
        m.weight, m.bias, spec.conv1d, spec.sites, spec.groups, spec.site_groups, spec.interleaved
    )


def _projection_hook(state: AttentionState, spec: ProjectionSpec) -> Callable[..., None]:
    checked = any(state.checks(s) for s in spec.sites)

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
        if checked:
            state.defer(proj, args[0], y, last=spec.last)

    return hook


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
    chosen = [b for b in blocks if config.layers is None or b.layer in config.layers]
    if not chosen:
        raise NoMatchingModuleError(
            f"layers={config.layers} selects none of the {len(blocks)} attention layers "
            f"(indices {sorted(b.layer for b in blocks)})"
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
    handle = ProtectionHandle(config, states, clock)
    for b in blocks:
        setattr(b.core, CORE, (b.spec, states.get(b.name)))
    handle._undo.append(lambda: [delattr(b.core, CORE) for b in blocks])
    for b in chosen:
        for p in b.projections:
            handle._undo.append(
                p.module.register_forward_hook(_projection_hook(states[b.name], p)).remove
            )
    handle._undo.append(install(model, found, fused=fused))

    def tick(module: nn.Module, *_: object) -> None:
        clock.tick(_device(module, clock.count.device))

    handle._undo.append(model.register_forward_pre_hook(tick).remove)
    setattr(model, _HANDLE, handle)
    handle._undo.append(lambda: delattr(model, _HANDLE))
    return handle


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
