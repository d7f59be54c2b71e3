"""``protect_`` and ``unprotect_``: one call to check a model's attention, one to undo it.

Protection wraps, it does not copy: forward hooks on the projection submodules check and repair
their outputs, and the attention core is routed through :func:`attnchecker.attention.core.attend`.
No parameter, buffer or module is added or replaced, so ``state_dict()`` is unchanged and
``unprotect_`` restores the model exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.profiler import record_function

from attnchecker.attention.checks import Projection, input_sums, projection_check_, weight_sums
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.state import AttentionState, Clock
from attnchecker.errors import ConfigError, NoMatchingModuleError
from attnchecker.models.handle import ProtectionHandle
from attnchecker.models.registry import CORE, ProjectionSpec, adapter_for

__all__ = ["protect_", "unprotect_"]

_HANDLE = "_attnchecker_handle"


def _projection(spec: ProjectionSpec) -> Projection:
    m = spec.module
    if spec.conv1d:  # y = addmm(b, x, W) with W stored (in, out)

        def compute(x: Tensor, features: Tensor | None) -> Tensor:
            if features is None:
                return torch.addmm(m.bias, x, m.weight)
            return torch.addmm(
                m.bias.index_select(0, features), x, m.weight.index_select(1, features)
            )

        return Projection(m.weight.T, m.bias, compute)

    def compute_linear(x: Tensor, features: Tensor | None) -> Tensor:
        if features is None:
            return F.linear(x, m.weight, m.bias)
        bias = None if m.bias is None else m.bias.index_select(0, features)
        return F.linear(x, m.weight.index_select(0, features), bias)

    return Projection(m.weight, m.bias, compute_linear)


def _projection_hook(state: AttentionState, spec: ProjectionSpec) -> Callable[..., None]:
    checked = [s for s in spec.sites if state.checks(s)]
    label = f"attnchecker.{'+'.join(checked)}"  # a profiler range per check, for benchmarks

    def hook(module: nn.Module, args: tuple[Tensor, ...], y: Tensor) -> None:
        x = args[0]
        if y.dim() != 3 or x.dim() != 3:
            return
        width = y.shape[-1] // len(spec.sites)
        for i, site in enumerate(spec.sites):
            state.site(site, y[..., i * width : (i + 1) * width])
        if checked:
            with record_function(label):
                _check_projection(state, spec, x, y)

    return hook


def _check_projection(state: AttentionState, spec: ProjectionSpec, x: Tensor, y: Tensor) -> None:
    key = spec.sites[0]
    proj = _projection(spec)
    w_sums = weight_sums(proj, spec.groups, len(spec.sites), state.cache.get(key))
    x_sums = input_sums(x, state.cache.get("input"))  # shared by the projections of one input
    state.cache[key], state.cache["input"] = w_sums, x_sums
    records, bounds = projection_check_(
        y,
        x,
        proj,
        w_sums,
        x_sums,
        max_rows=state.config.max_rows,
        scale=state.config.tolerance_scale,
    )
    for site, rec in zip(spec.sites, records, strict=True):
        if state.checks(site):
            state.record(site, rec)
    if state.config.mode == "passing":
        _leave_bounds(state, spec, y, bounds)


def _leave_bounds(state: AttentionState, spec: ProjectionSpec, y: Tensor, bounds) -> None:
    """Checksum passing: what the attention checks can take from this projection instead of
    recomputing it from Q, K and V (magnitude bounds, and V's per-head row sums once V is
    checked and repaired)."""
    B, L, N = y.shape
    P = len(spec.sites)
    width, groups = N // P, spec.groups // P
    for i, site in enumerate(spec.sites):
        if not state.checks(site):
            continue
        heads = bounds.head_rows[..., i * groups : (i + 1) * groups]  # (B, L, G)
        if site == "q":
            state.passing["q_rows"] = heads
        elif site == "k":
            state.passing["k_features"] = bounds.features[:, i * width : (i + 1) * width]
        elif site == "v":
            part = y[..., i * width : (i + 1) * width].reshape(B, L, groups, -1)
            state.passing["v_rows"] = (part.sum(-1, dtype=torch.float32), heads)


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
    adapter = adapter_for(model)
    blocks = adapter.blocks(model)
    chosen = [b for b in blocks if config.layers is None or b.layer in config.layers]
    if not chosen:
        raise NoMatchingModuleError(
            f"layers={config.layers} selects none of the {len(blocks)} attention layers "
            f"(indices {sorted(b.layer for b in blocks)})"
        )
    clock = Clock()
    states = {b.name: AttentionState(b.name, b.layer, config, clock) for b in chosen}
    handle = ProtectionHandle(config, states, clock)
    for b in blocks:
        setattr(b.core, CORE, (b.spec, states.get(b.name)))
    handle._undo.append(lambda: [delattr(b.core, CORE) for b in blocks])
    for b in chosen:
        for p in b.projections:
            handle._undo.append(
                p.module.register_forward_hook(_projection_hook(states[b.name], p)).remove
            )
    handle._undo.append(adapter.install(model, blocks))

    def tick(*_: object) -> None:
        clock.step += 1

    handle._undo.append(model.register_forward_pre_hook(tick).remove)
    setattr(model, _HANDLE, handle)
    handle._undo.append(lambda: delattr(model, _HANDLE))
    return handle


def unprotect_(model: nn.Module) -> None:
    """Remove protection: hooks, patches and attributes; the model is as it was."""
    handle = getattr(model, _HANDLE, None)
    if handle is None:
        raise ConfigError("the model is not protected")
    handle._remove()
