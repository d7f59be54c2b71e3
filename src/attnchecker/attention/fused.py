"""The engines of the attention core other than the eager math: the choice among them
(:func:`choose_engine`), the SDPA route's entry for the attention interface
(:func:`attend_sdpa_route`), and the fused backend: the checked flash kernels in place of the
eager math.

The attention interface calls :func:`attend_fused` with transformers' flash-attention mask
convention (the 2D key padding mask, or None) and the module's causality and sliding window.
Q, K and V have been checked by the projection hooks as in the eager engine; the kernels check
S, the softmax and P V in the forward and the backward GEMMs in the backward (each check
switched on by the config ops of ``attnchecker.kernels.KERNEL_CHECKS``, at the config's
``tolerance_scale``), and add their detections to the state's device counters (no host
synchronisation). ``max_heads`` does not limit them: every failing tile is recomputed in the
kernel, at most one re-run of a program's loop.

A call the kernels do not cover runs the eager engine instead (:func:`attend`, with the eager
additive mask built from the same inputs), with a warning once per reason: attention dropout
in training (the kernels have no in-kernel dropout), logit soft-capping, fp32 on a GPU without
TF32 at head sizes above ``kernels.flash.FP32_MAX_HEAD`` (register spills), and the eager-only
options of GPT-2 (``reorder_and_upcast_attn``) and GPT-Neo (fp32 q and k, no scaling).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from attnchecker.attention.config import ALL_OPS, ABFTConfig
from attnchecker.attention.core import CoreSpec, attend, output_layout
from attnchecker.attention.projection import flush
from attnchecker.attention.state import AttentionState
from attnchecker.errors import ConfigError, UnsupportedModelError

__all__ = ["attend_fused", "attend_sdpa_route", "choose_engine", "eager_mask"]

_WARNED: set[tuple[str, str]] = set()


def choose_engine(
    config: ABFTConfig, device: torch.device, *, family: str, interface: bool
) -> tuple[str, str]:
    """Which engine runs the attention core of a model on ``device`` (``config.backend``):
    ``("sdpa", "")`` for the SDPA route (``"auto"`` on CUDA), ``("triton", "")`` for the fused
    kernels, or ``("eager", why)``, why saying what made ``backend="auto"`` choose eager.
    ``interface``: the family dispatches through transformers' attention interface, or the
    model calls SDPA (what both routes plug into)."""
    from attnchecker import kernels

    if config.backend == "eager":
        return "eager", ""
    if config.backend == "sdpa":
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"backend='sdpa' runs the CPU and CUDA SDPA kernels; the model is on {device}: "
                f"use backend='eager'"
            )
        if not interface:
            raise UnsupportedModelError(
                f"backend='sdpa': {family} does not dispatch through transformers' attention "
                f"interface or call F.scaled_dot_product_attention; use backend='eager'"
            )
        return "sdpa", ""
    if config.backend == "triton":
        if not kernels.available():
            raise ConfigError(
                "backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU, "
                "tests only); use backend='eager' or 'auto'"
            )
        if not interface:
            raise UnsupportedModelError(
                f"backend='triton': {family} does not dispatch through transformers' "
                f"attention interface; use backend='eager' or 'auto'"
            )
        return "triton", ""
    why = "backend='auto' chose eager"
    if device.type != "cuda":
        return "eager", (
            f"{why}: the model was on {device} at protect_ (protect it after moving it to CUDA "
            f"for the SDPA route)"
        )
    if not interface:
        return "eager", f"{why}: the model's attention is not SDPA the route can take over"
    from attnchecker.attention.sdpa_core import self_test

    reason = self_test(device)  # the route: modelled far below the fused kernels (docs/gpu.md)
    if reason is not None:
        warnings.warn(
            f"backend='auto': the SDPA route failed its self-test on {device} ({reason}); the "
            f"checked eager attention runs instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return "eager", f"{why}: the SDPA route failed its self-test ({reason})"
    return "sdpa", ""


def _fell_back(state: AttentionState, reason: str, backend: str, what: str) -> None:
    """Name a call the engine does not cover in ``summary()`` and warn once per reason."""
    if not torch.compiler.is_compiling():  # summary() names it (a warning is once a process)
        state.coverage.fallbacks.add(reason)
    if (backend, reason) not in _WARNED:
        _WARNED.add((backend, reason))
        warnings.warn(
            f"attnchecker backend={backend!r}: {reason} is not covered by {what}; those calls "
            f"run the checked eager attention",
            RuntimeWarning,
            stacklevel=4,
        )


def _fallback_reason(
    spec: CoreSpec, dropout: float, training: bool, softcap: float | None, upcast: bool
) -> str | None:
    reasons = {
        "attention dropout in training": training and dropout > 0,
        "logit soft-capping": softcap is not None,
        "reorder_and_upcast_attn": upcast,
        "fp32 q and k without scaling (GPT-Neo)": spec.upcast_qk or not spec.scale,
    }
    return next((r for r, on in reasons.items() if on), None)


def eager_mask(
    key_mask: Tensor | None, L: int, Lk: int, *, causal: bool, window: int, dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:  # fmt: skip
    """The eager additive mask (B or 1, 1, L, Lk) of a causal / windowed / padded call (query i
    at key position Lk - L + i), finfo.min where a key is excluded."""
    if key_mask is None and not causal and not window:
        return None
    i = torch.arange(L, device=device)[:, None] + (Lk - L)
    j = torch.arange(Lk, device=device)[None, :]
    ok = torch.ones(L, Lk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    ok = ok[None, None]
    if key_mask is not None:
        ok = ok & key_mask.bool()[:, None, None, :]
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(ok, zero, torch.finfo(dtype).min)


def attend_fused(
    spec: CoreSpec,
    state: AttentionState,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_mask: Tensor | None,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    causal: bool,
    window: int,
    softcap: float | None = None,
    upcast_reordered: bool = False,
) -> tuple[Tensor, None]:
    """Checked attention of q (B, H, L, d), k and v (B, Hkv, Lk, d) by the fused kernels:
    (output in the family's layout, None: no probabilities are materialised)."""
    from attnchecker.kernels import checks_of
    from attnchecker.kernels.flash import FP32_MAX_HEAD, operand_kind
    from attnchecker.kernels.ops import flash_attention

    reason = _fallback_reason(spec, dropout, training, softcap, upcast_reordered)
    wide = query.is_cuda and query.shape[-1] > FP32_MAX_HEAD
    if reason is None and wide and operand_kind(query) == "fp32":
        reason = f"fp32 without TF32 at head size > {FP32_MAX_HEAD} (the kernels spill)"
    if reason is not None:
        _fell_back(state, reason, "triton", "the fused kernels")
        L, Lk = query.shape[-2], key.shape[-2]
        mask = eager_mask(key_mask, L, Lk, causal=causal, window=window, dtype=query.dtype,
                          device=query.device)  # fmt: skip
        return attend(
            spec, query, key, value, mask, scaling=scaling, dropout=dropout, training=training,
            state=state, upcast_reordered=upcast_reordered, softcap=softcap,
        )  # fmt: skip
    flush(state)  # projections still waiting for their group (Q alone)
    state.handoff = None
    fault = state.kernel_fault
    if callable(fault):  # an injector's: it decides from the step and the shapes
        fault = fault(query, key)
    out = flash_attention(
        query, key, value, causal=causal, window=window,
        key_mask=None if key_mask is None else key_mask.bool(), scale=scaling,
        counts=state.records.kernel, sink=state.records.kernel_sink, fault=fault,
        check=checks_of(op for op in ALL_OPS if state.checks(op)),
        tolerance_scale=state.config.tolerance_scale,
    )  # fmt: skip
    if not state.checks("out"):
        state.commit()
    return output_layout(spec, out), None


def attend_sdpa_route(
    spec: CoreSpec,
    state: AttentionState,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    causal: bool,
    softcap: float | None = None,
    upcast_reordered: bool = False,
) -> tuple[Tensor, None]:
    """Checked attention of q (B, H, L, d), k and v (B, Hkv, Lk, d) by the backend's SDPA kernel
    (:mod:`~attnchecker.attention.sdpa_core`; ``mask``: transformers' SDPA mask, 4-D bool or
    None, then ``causal``): (output in the family's layout, None). What SDPA cannot compute as
    the family does (attention dropout in training: the repair could not redraw it; soft-capping;
    GPT-2's ``reorder_and_upcast_attn``, GPT-Neo's fp32 q and k) runs the checked eager
    attention, named in ``summary()``, with a warning once."""
    from attnchecker.attention.sdpa_core import attend_sdpa

    reason = _fallback_reason(spec, dropout, training, softcap, upcast_reordered)
    if reason is not None:
        _fell_back(state, reason, "sdpa", "the SDPA route")
        L, Lk = query.shape[-2], key.shape[-2]
        if mask is None:
            eager = eager_mask(None, L, Lk, causal=causal, window=0, dtype=query.dtype,
                               device=query.device)  # fmt: skip
        else:
            low = torch.finfo(query.dtype).min
            eager = torch.where(mask, torch.zeros((), dtype=query.dtype, device=mask.device), low)
        return attend(
            spec, query, key, value, eager, scaling=scaling, dropout=dropout, training=training,
            state=state, upcast_reordered=upcast_reordered, softcap=softcap,
        )  # fmt: skip
    flush(state)  # projections still waiting for their group (Q alone)
    state.handoff = None
    out = attend_sdpa(state, query, key, value, mask, scaling=scaling, causal=causal)
    if not state.checks("out"):
        state.commit()
    return output_layout(spec, out), None
