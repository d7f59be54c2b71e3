"""The engines of the attention core, as values, and the one function that runs any of them.

An engine computes a protected module's attention core and checks it: :data:`EAGER`, the
checked eager math (:func:`~attnchecker.attention.core.attend`: materialised scores,
checksums that see any error above rounding); :data:`SDPA`, the SDPA route (the backend's own
kernel checked by the invariants of what it returns, :mod:`~attnchecker.attention.sdpa_core`);
:data:`FLASH`, the fused flash kernels with their checks inside (:mod:`attnchecker.kernels`).
:func:`choose_engine` picks one per model at ``protect_`` (``ABFTConfig.backend``); it is held
on each module's :class:`~attnchecker.attention.state.Coverage`, and the entries (the attention
interface, the SDPA interception, GPT-Neo's ``_attn``) describe a call as a :class:`CoreCall`
and hand it to :func:`run_core`, which owns what every engine needs around it:

- the set-up (:func:`before_core`): the queued projection checks run first (the core reads
  their outputs), and what they left for the core (``mode="passing"``) is taken;
- the fallback: a call the engine does not cover (:meth:`Engine.cannot`: logit soft-capping,
  GPT-2's ``reorder_and_upcast_attn``, GPT-Neo's fp32 q and k; for the fused kernels attention
  dropout in training, fp32 without TF32 at wide heads and masks they do not take; for the SDPA
  route attention dropout under torch.compile (its rerun needs the generator's state, which
  dynamo does not trace) and emulated core faults in a dropout call on CUDA, whose kernels keep
  their draw) runs the
  checked eager engine on the eager form of the call's mask, named in ``summary()``, with a
  warning once per reason;
- the commit: the layer's records are written unless the output projection's check, which
  comes later, writes them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnchecker.attention.config import ALL_OPS, ABFTConfig
from attnchecker.attention.core import CoreSpec, attend, output_layout
from attnchecker.attention.handoff import Handoff
from attnchecker.attention.ops import CORE_OPS
from attnchecker.attention.projection import flush
from attnchecker.attention.state import AttentionState
from attnchecker.errors import ConfigError, UnsupportedModelError

__all__ = [
    "EAGER", "FLASH", "SDPA", "CoreCall", "Engine", "before_core", "choose_engine", "run_core",
]  # fmt: skip

_WARNED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class CoreCall:
    """One attention call as an engine takes it: q (B, H, L, d), k and v (B, Hkv, Lk, d), the
    family's :class:`~attnchecker.attention.core.CoreSpec` and options, and the mask in the form
    the entry has it (``mask``: transformers' eager mask for the eager engine, its SDPA mask or
    SDPA's ``attn_mask`` for the SDPA route, a (B, Lk) key mask for the fused kernels) with
    ``eager_mask()``, the same mask as the eager core takes it (for a fallback)."""

    spec: CoreSpec
    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    eager_mask: Callable[[], Tensor | None]
    scaling: float
    dropout: float
    training: bool
    causal: bool = False  # SDPA route: top-left; fused kernels: query i at key Lk - L + i
    window: int = 0  # the fused kernels' sliding window (0: none)
    softcap: float | None = None  # Gemma 2's logit soft-capping
    upcast_reordered: bool = False  # GPT-2's reorder_and_upcast_attn
    neo_causal: Tensor | None = None  # GPT-Neo's boolean causal (or windowed) bias
    prefill: bool = False  # an empty static cache's prefill may pass more keys than queries
    refused: str | None = None  # why the entry's mask is not this engine's (the eager runs)


class Engine:
    """An engine of the attention core: ``name`` (``summary()``'s), and whether it is the fused
    kernels (``counters``: int32 counters in the records, the core always checked by them, the
    core's backward GEMMs checked inside them)."""

    name = "eager"
    counters = False

    def cannot(self, call: CoreCall, state: AttentionState | None = None) -> str | None:
        """Why this engine does not compute ``call`` (for ``state``'s module) as the family
        does (None: it does)."""
        return None

    def attend(
        self, state: AttentionState, call: CoreCall, handoff: object
    ) -> tuple[Tensor, Tensor | None]:
        """(output in the family's layout, probabilities or None) of the checked core."""
        v_sums = None
        if isinstance(handoff, Handoff) and state.config.mode == "passing":
            v_sums = handoff.for_core(call.value)
        return attend(
            call.spec, call.query, call.key, call.value, call.mask, scaling=call.scaling,
            dropout=call.dropout, training=call.training, state=state, causal=call.neo_causal,
            upcast_reordered=call.upcast_reordered, softcap=call.softcap, v_sums=v_sums,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"<engine {self.name}>"


def _dropping(call: CoreCall) -> bool:
    """Whether the call applies attention dropout (training, p > 0)."""
    return call.training and call.dropout > 0


def _uncovered(call: CoreCall) -> str | None:
    """What neither the SDPA route nor the fused kernels compute as the family does."""
    reasons = {
        "logit soft-capping": call.softcap is not None,
        "reorder_and_upcast_attn": call.upcast_reordered,
        "fp32 q and k without scaling (GPT-Neo)": call.spec.upcast_qk or not call.spec.scale,
    }
    return next((r for r, on in reasons.items() if on), call.refused)


class _Sdpa(Engine):
    name = "sdpa"

    def cannot(self, call, state=None):
        why = _uncovered(call)
        if why is None and _dropping(call) and torch.compiler.is_compiling():
            why = "attention dropout under torch.compile"  # (the draw's start: a host read)
        if why is None and _dropping(call) and call.query.is_cuda and state is not None:
            hooked = any(state.hooks.get(s) for s in CORE_OPS)
            if hooked:  # the eager S, P, O need the draw, which CUDA's kernels keep
                why = "emulated core faults with attention dropout on CUDA"
        return why

    def attend(self, state, call, handoff):
        from attnchecker.attention.sdpa_core import checked_attention

        key, value = call.key, call.value
        L, Lk = call.query.shape[2], key.shape[2]
        if call.prefill and call.causal and call.mask is None and Lk > L:  # as transformers
            key, value = key[:, :, :L], value[:, :, :L]
        out = checked_attention(state, call.query, key, value, call.mask, causal=call.causal,
                                scale=call.scaling,
                                dropout=call.dropout if _dropping(call) else 0.0)  # fmt: skip
        return output_layout(call.spec, out), None


class _Flash(Engine):
    name = "triton"
    counters = True

    def cannot(self, call, state=None):
        from attnchecker.kernels.flash import FP32_MAX_HEAD, operand_kind

        q = call.query
        why = "attention dropout in training" if _dropping(call) else _uncovered(call)
        if why is None and q.is_cuda and q.shape[-1] > FP32_MAX_HEAD and operand_kind(q) == "fp32":
            why = f"fp32 without TF32 at head size > {FP32_MAX_HEAD} (the kernels spill)"
        return why

    def attend(self, state, call, handoff):
        from attnchecker.kernels import checks_of
        from attnchecker.kernels.ops import flash_attention

        fault = state.kernel_fault
        if callable(fault):  # an injector's: it decides from the step and the shapes
            fault = fault(call.query, call.key)
        out = flash_attention(
            call.query, call.key, call.value, causal=call.causal, window=call.window,
            key_mask=None if call.mask is None else call.mask.bool(), scale=call.scaling,
            counts=state.records.direct_counts(), sink=state.records.kernel_sink, fault=fault,
            check=checks_of(op for op in ALL_OPS if state.checks(op)),
            tolerance_scale=state.config.tolerance_scale,
        )  # fmt: skip
        return output_layout(call.spec, out), None


EAGER, SDPA, FLASH = Engine(), _Sdpa(), _Flash()
"""The engines: the checked eager math, the SDPA route, the fused flash kernels."""


def before_core(state: AttentionState) -> object | None:
    """What runs before any attention of a protected module, checked core or the model's own:
    the projections still queued (Q alone, or a group that never completed) are checked, since
    the attention reads their outputs; returns what they left for the core (``mode="passing"``)."""
    flush(state)
    handoff, state.handoff = state.handoff, None
    return handoff


def run_core(engine: Engine, state: AttentionState, call: CoreCall) -> tuple[Tensor, Tensor | None]:
    """The checked attention core of ``call`` by ``engine`` (the checked eager engine for a
    call it does not cover), with the set-up before it and the commit after it: (output in the
    family's layout, probabilities or None)."""
    why = engine.cannot(call, state)
    if why is not None:
        _fell_back(state, why, engine)
        call = dataclasses.replace(call, mask=call.eager_mask())
        engine = EAGER
    handoff = before_core(state)
    out, probs = engine.attend(state, call, handoff)
    if not state.checks("out"):
        state.commit()  # otherwise the output projection's check writes the layer's records
    return out, probs


def _fell_back(state: AttentionState, reason: str, engine: Engine) -> None:
    """Name a call the engine does not cover in ``summary()`` and warn once per reason, from
    eager code: inside a model being compiled the call still runs the checked eager engine, but
    unnamed (dynamo cannot trace a warning, nor the set's update; a warning there broke a
    ``fullgraph=True`` compile), so ``summary()`` names what eager calls met."""
    if torch.compiler.is_compiling():
        return
    state.coverage.fallbacks.add(reason)  # summary() names it (a warning is once a process)
    if (engine.name, reason) not in _WARNED:
        _WARNED.add((engine.name, reason))
        what = "the fused kernels" if engine.counters else "the SDPA route"
        warnings.warn(
            f"attnchecker backend={engine.name!r}: {reason} is not covered by {what}; those "
            f"calls run the checked eager attention",
            RuntimeWarning,
            stacklevel=4,
        )


def choose_engine(
    config: ABFTConfig, device: torch.device, *, family: str, interface: bool
) -> tuple[Engine, str]:
    """Which engine runs the attention core of a model on ``device`` (``config.backend``):
    (:data:`SDPA`, "") for the SDPA route (``"auto"`` on CUDA), (:data:`FLASH`, "") for the
    fused kernels, or (:data:`EAGER`, why), why saying what made ``backend="auto"`` choose it.
    ``interface``: the family dispatches through transformers' attention interface, or the
    model calls SDPA (what both routes plug into)."""
    from attnchecker import kernels

    if config.backend == "eager":
        return EAGER, ""
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
        return SDPA, ""
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
        return FLASH, ""
    why = "backend='auto' chose eager"
    if device.type != "cuda":
        return EAGER, (
            f"{why}: the model was on {device} at protect_ (protect it after moving it to CUDA "
            f"for the SDPA route)"
        )
    if not interface:
        return EAGER, f"{why}: the model's attention is not SDPA the route can take over"
    from attnchecker.attention.sdpa_core import self_test

    reason = self_test(device)  # the route: modelled far below the fused kernels (docs/gpu.md)
    if reason is not None:
        warnings.warn(
            f"backend='auto': the SDPA route failed its self-test on {device} ({reason}); the "
            f"checked eager attention runs instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return EAGER, f"{why}: the SDPA route failed its self-test ({reason})"
    return SDPA, ""
