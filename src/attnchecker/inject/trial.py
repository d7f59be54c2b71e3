"""One campaign trial: the same short training fault-free, unprotected and protected.

A trial puts one fault (a :class:`~attnchecker.inject.plan.Fault` at step 1 of a chosen layer)
into a short training run twice, once without and once with ``protect_``, and classifies:

- the *outcome* of each run against the fault-free run: ``masked`` (every step's loss within
  ``tol`` relative, parameters within ``param_tol`` absolute: a repaired value comes from a
  smaller GEMM that rounds differently, and AdamW's first steps divide by |grad|, which can turn
  that rounding into up to ~lr of parameter difference on near-zero gradients),
  ``silent_deviation`` (finite but different), ``loss_spike`` (a loss above
  ``spike_factor`` times the fault-free maximum) or ``non_trainable`` (a non-finite loss or
  non-finite parameters);
- for the unprotected run, the *propagation pattern* of the error at the scores, context and
  output projection of the faulty layer and at the next layer's input (none, 0D, 1R, 1C, 2D);
- for the protected run, what protection did: ``corrected``, ``recomputed``, ``uncorrectable``,
  ``missed`` (not detected but the outcome is not masked) or ``not_needed`` (masked, not detected).

A *recovery arm* (``recover="skip"`` or ``"replay"``) runs the fault under what a user does with a
step that went wrong (an uncorrectable error, a non-finite loss or gradient): skip its update, or
replay it on its batch and random state (:mod:`attnchecker.recovery.replay`), with protection or
without (the finite-gradient guard alone). Every arm's result is also classed as the user meets
it (:func:`user_outcome`, :data:`USER_OUTCOMES`): masked, corrected in place, replayed, skipped,
silent deviation or non-trainable, with the SDC study's measures of a deviation (the final
loss's relative difference, the parameters' relative L2 distance).

A *check arm* (``check=("scores", 2)``) runs the same fault with one check alone: that op in
that layer, every step, under the policy a plan ships (``skip_step`` with the guarded
optimizer, so a detection it cannot correct skips the update). A campaign's check arms measure
which checks cover a fault at another site (:mod:`attnchecker.adaptive.profile`).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.ops import INVARIANT_OPS, linear_parts
from attnchecker.errors import ConfigError
from attnchecker.inject.injector import Injector
from attnchecker.inject.plan import Fault, FaultPlan, check_op
from attnchecker.models.registry import role_of

__all__ = [
    "RECOVERIES", "USER_OUTCOMES", "TrialSetup", "check_arm_config", "departed",
    "observe_pattern", "param_distance", "reference", "run_arm", "user_outcome",
]  # fmt: skip

OBSERVED = ("scores", "context", "out", "next_input")
RECOVERIES = ("skip", "replay")  # what a recovery arm does with a step that went wrong
INVARIANT_SITES = tuple(op for op in INVARIANT_OPS if op != "update.momentum_buffer")  # AdamW's
"""Campaign sites of the checks beyond the GEMMs (``ABFTConfig.invariants``), named as their
events' ops: ``norm``, the output of the first norm module of the faulty layer's block (layer
-1: a norm outside the blocks, the final one); ``update.<key>``, AdamW's ``exp_avg`` /
``exp_avg_sq`` or the parameter of the block's first weight matrix (layer -1: the first one
outside the blocks), just before step 2's update (a first step has no state yet)."""

USER_OUTCOMES = ("masked", "corrected", "replayed", "skipped", "silent_deviation", "non_trainable")
"""A fault as a user meets it: no effect (masked), repaired in place by protection (corrected), a
step recomputed (replayed), an update skipped (skipped), finite parameters that differ from the
fault-free run's with nothing detected (silent_deviation; a loss spike counts here too), or a
non-finite loss or parameters (non_trainable)."""


@dataclass
class TrialSetup:
    """What every trial of one family shares: the model, data and the fault-free reference."""

    family: str
    model: nn.Module
    batches: list[dict[str, Tensor]]
    lr: float
    ref_losses: list[float]
    ref_params: dict[str, Tensor]
    ref_seen: dict[str, Tensor]  # clean tensors at the observed places, step 1
    backend: str = "eager"  # the attention backend of every arm (ABFTConfig.backend)
    example: tuple[Tensor, ...] | None = None  # protect_'s traced forward (a model of one's own)


def invariant_fault(model: nn.Module, site: str, layer: int, **kw: Any) -> Fault:
    """The :class:`Fault` of a campaign's :data:`INVARIANT_SITES` site in ``model``."""
    from attnchecker.models.norms import find_norms

    def in_layer(name: str) -> bool:
        parts = name.split(".")
        idx = [int(p) for p in parts if p.isdigit()]
        return (idx[:1] == [layer]) if layer >= 0 else not idx

    if site == "norm":
        names = [n for n, _ in find_norms(model) if in_layer(n)]
        target, step = f"module:{names[0]}" if names else None, 1
    else:
        names = [n for n, p in model.named_parameters() if p.dim() == 2 and in_layer(n)
                 and "embed" not in n and "wte" not in n and "wpe" not in n]  # fmt: skip
        key = site.split(".", 1)[1]
        target, step = f"optim:{names[0]}:{key}" if names else None, 2
    if target is None:
        raise ConfigError(f"no {'norm module' if site == 'norm' else 'weight'} in layer {layer}")
    return Fault(step=step, site=target, layer=layer, **kw)


def _train(model: nn.Module, batches: list[dict[str, Tensor]], lr: float, seed: int,
           guarded: Any = None, recover: str | None = None, handle: Any = None,
           opt: Any = None) -> tuple[list[float], list[Any], list[bool], int]:  # fmt: skip
    """Train on ``batches``; with ``guarded`` (a protection handle) the optimizer is guarded
    by it and drained every step (what ``skip_step`` needs); with ``recover`` a step that went
    wrong is skipped or replayed (``handle``: protection's, or None). (losses, events drained,
    whether each step's update was skipped, steps replayed)."""
    from attnchecker.recovery.guard import guard

    opt = torch.optim.AdamW(model.parameters(), lr=lr) if opt is None else opt
    torch.manual_seed(seed)  # the same dropout masks in every arm
    if recover is not None:
        return _recovering(model, batches, opt, recover, handle)
    step = opt if guarded is None else guard(opt, guarded, names=model)
    losses, events, skipped = [], [], []
    for inputs in batches:
        loss = model(**inputs).loss
        loss.backward()
        step.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        total = 0 if guarded is None or step.skipped is None else int(step.skipped)
        skipped.append(total > sum(skipped))
        if guarded is not None:
            events += guarded.drain()
    return losses, events, skipped, 0


def _recovering(model: nn.Module, batches: list[dict[str, Tensor]], opt: Any, recover: str,
                handle: Any) -> tuple[list[float], list[Any], list[bool], int]:  # fmt: skip
    """:func:`_train` under a recovery (``skip`` or ``replay``, :data:`RECOVERIES`)."""
    from attnchecker.recovery.replay import Replayer

    losses, events, skipped, replays = [], [], [], 0
    stepper = Replayer(opt, handle, replay=recover == "replay")
    for inputs in batches:

        def closure(inputs=inputs) -> Tensor:
            loss = model(**inputs).loss
            loss.backward()
            return loss

        out = stepper.step(closure)
        replays += out.replayed
        events += out.events
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        skipped.append(out.skipped)
    return losses, events, skipped, replays


def _observe(model: nn.Module, handle: Any, layer: int, seen: dict[str, Tensor]) -> list[Any]:
    """Record clones of the observed tensors at step 1 of ``layer``; returns the detachers."""

    def at_site(call: Any) -> None:
        if call.layer == layer and call.step == 1 and not call.replay and call.site in OBSERVED:
            seen.setdefault(call.site, call.tensor.detach().clone())

    detach = [handle.attach(at_site, sites=("scores", "context", "out"))]
    nxt = _layer_after(model, layer)
    if nxt is not None:

        def pre(module: nn.Module, args: tuple) -> None:
            if "next_input" not in seen and args and isinstance(args[0], Tensor):
                seen["next_input"] = args[0].detach().clone()

        detach.append(nxt.register_forward_pre_hook(pre))
    return detach


def _layer_after(model: nn.Module, layer: int) -> nn.Module | None:
    """The transformer block ``layer + 1`` (the one whose input shows what left ``layer``)."""
    for name, m in model.named_modules():
        parts = name.split(".")
        if parts[-1] == str(layer + 1) and parts[-2] in ("layer", "h", "layers"):
            return m
    return None


def observe_pattern(clean: Tensor | None, faulty: Tensor | None, tol: float = 1e-5) -> str:
    """none / 0D / 1R / 1C / 2D of the elements that differ, in the matrix (last two dims) that
    differs most; 'none' when nothing differs beyond ``tol`` (relative)."""
    from attnchecker.models.handle import pattern_of

    if clean is None or faulty is None:
        return "n/a"
    a, b = clean.double(), faulty.double()
    differs = ~((a - b).abs() <= tol * (1 + a.abs())) & ~(a.isnan() & b.isnan())
    if a.dim() == 2:
        differs = differs[None]
    mats = differs.reshape(-1, *differs.shape[-2:])
    if not mats.any():
        return "none"
    worst = mats[int(mats.flatten(1).sum(1).argmax())]
    return pattern_of(int(worst.any(-1).sum()), int(worst.any(-2).sum()))


def _outcome(
    losses: list[float],
    params: dict[str, Tensor],
    setup: TrialSetup,
    tol: float,
    param_tol: float,
    spike: float,
    skipped: list[bool],
) -> tuple[str, float]:
    """The outcome (module docstring) and the largest parameter drift. The loss of a step whose
    update the guard skipped is not the model's: it is not judged (training went on without
    it), the parameters are."""
    drift = max(float((params[k] - v).abs().max()) for k, v in setup.ref_params.items())
    pairs = [(a, b) for a, b, s in zip(losses, setup.ref_losses, skipped, strict=True) if not s]
    finite = all(math.isfinite(a) for a, _ in pairs) and all(
        torch.isfinite(p).all() for p in params.values()
    )
    if not finite:
        return "non_trainable", drift
    if pairs and max(a for a, _ in pairs) > spike * max(setup.ref_losses):
        return "loss_spike", drift
    return ("silent_deviation" if departed(pairs, drift, tol, param_tol) else "masked"), drift


def departed(pairs: list[tuple[float, float]], drift: float, tol: float, param_tol: float) -> bool:
    """Whether a run went away from the fault-free one (its losses and theirs, step by step;
    the largest parameter drift): a loss more than ``tol`` away (relative) or a parameter more
    than ``param_tol`` (absolute)."""
    loss_dev = max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=0.0)
    return not (loss_dev <= tol and drift <= param_tol)


def run_arm(
    setup: TrialSetup,
    fault: Fault,
    seed: int,
    *,
    protected: bool,
    tol: float,
    param_tol: float,
    spike: float,
    check: tuple[str, int] | None = None,
    recover: str | None = None,
) -> dict[str, Any]:
    """One faulty training run; returns its outcome, propagation and protection result, and as
    the user meets it (``user``). ``check``: a check arm (module docstring), the op checked
    alone and its layer; ``recover``: a recovery arm (``skip`` / ``replay``)."""
    from attnchecker.models.protect import protect_

    model = copy.deepcopy(setup.model)
    config = ABFTConfig(policy="warn") if protected else ABFTConfig(ops=())
    if protected and fault.family == "linear":  # every linear layer checked too
        config = config.replace(scope="all_linear")
    if check is not None:
        config = check_arm_config(*check)
    invariant = fault.family in ("module", "optim")  # a campaign's INVARIANT_SITES
    if protected and invariant:
        config = config.replace(invariants=("norm", "update"))
    if recover is not None:
        config = config.replace(policy="replay" if recover == "replay" else "skip_step")
    handle = protect_(model, config.replace(backend=setup.backend), example=setup.example)
    plan = FaultPlan((fault,), seed)
    seen: dict[str, Tensor] = {}
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    with Injector(model, plan, optimizer=opt) as inj, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        detach = _observe(model, handle, fault.layer, seen) if not (protected or recover) else []
        # the update check runs in the guard; the guard drains every step
        guarded = handle if check is not None or (protected and invariant) else None
        losses, events, skipped, replays = _train(
            model, setup.batches, setup.lr, seed=0, guarded=guarded, recover=recover,
            handle=handle if protected else None, opt=opt,
        )  # fmt: skip
        for d in detach:
            d.remove()
        events += handle.drain()
    params = {n: p.detach() for n, p in model.named_parameters()}
    outcome, drift = _outcome(losses, params, setup, tol, param_tol, spike, skipped)
    out: dict[str, Any] = {
        "outcome": outcome,
        "fired": bool(inj.records),
        "final_loss": losses[-1],
        "param_drift": drift,
        **_deviation(losses[-1], params, setup),
    }
    if guarded is not None or recover is not None:
        out["skipped"] = sum(skipped)  # updates the guard skipped
    if recover is not None:
        out["replayed"] = replays
    if inj.records:
        r = inj.records[0]
        out["fault"] = {
            "index": r.index,
            "n_elements": r.n_elements,
            "old": r.old[:4],
            "new": r.new[:4],
        }
    if protected:
        if fault.family == "kernel":  # whichever of the kernels' checks saw it
            from attnchecker.kernels.flash import CHECKS

            mine = [e for e in events if e.op in CHECKS and e.layer == fault.layer]
        elif fault.family == "linear":
            role, op = linear_parts(check_op(fault.site))
            here = (op, fault.layer, role)
            mine = [e for e in events if (e.op, e.layer, role_of(e.module)) == here]
        elif invariant:  # the norm's or the update's check, at the faulty tensor
            name, key = fault.site.split(":")[1], fault.site.split(":")[-1]
            op = "norm" if fault.family == "module" else f"update.{key}"
            mine = [e for e in events if e.op == op and e.module == name]
        else:
            mine = [e for e in events if e.op == fault.site and e.layer == fault.layer]
        actions = {e.action for e in events}
        if "uncorrectable" in actions:
            result = "uncorrectable"
        elif "recomputed" in actions:
            result = "recomputed"
        elif "corrected" in actions:
            result = "corrected"
        else:
            result = "not_needed" if outcome == "masked" else "missed"
        out.update(
            result=result, detected_at_site=bool(mine), events=[e.to_dict() for e in events][:8]
        )
    elif recover is None:
        out["propagation"] = {
            k: observe_pattern(setup.ref_seen.get(k), seen.get(k)) for k in OBSERVED
        }
    out["user"] = user_outcome(out)
    return out


def user_outcome(arm: dict[str, Any]) -> str:
    """An arm's result as the user meets it (:data:`USER_OUTCOMES`): non-trainable first, then
    a skipped update (its parameters differ from the fault-free run's by the skipped update,
    which is not a silent deviation), a replay, a silent deviation, a correction."""
    if arm["outcome"] == "non_trainable":
        return "non_trainable"
    if arm.get("skipped", 0):
        return "skipped"
    if arm.get("replayed", 0):
        return "replayed" if arm["outcome"] == "masked" else "silent_deviation"
    if arm["outcome"] in ("silent_deviation", "loss_spike"):
        return "silent_deviation"
    if arm.get("result") in ("corrected", "recomputed"):
        return "corrected"
    return "masked"


def _deviation(final_loss: float, params: dict[str, Tensor], setup: TrialSetup) -> dict[str, float]:
    """The SDC study's measures against the fault-free run: the final loss's relative difference
    and the parameters' relative L2 distance."""
    ref = setup.ref_losses[-1]
    keys = list(setup.ref_params)
    return {"loss_delta": (final_loss - ref) / max(abs(ref), 1e-12),
            "param_distance": param_distance([params[k] for k in keys],
                                             [setup.ref_params[k] for k in keys])}  # fmt: skip


def param_distance(params: list[Tensor], reference: list[Tensor]) -> float:
    """The parameters' relative L2 distance to ``reference`` (the SDC study's measure)."""
    diff = sum(float((x.double() - y.double()).square().sum())
               for x, y in zip(params, reference, strict=True))  # fmt: skip
    norm = sum(float(y.double().square().sum()) for y in reference)
    return math.sqrt(diff / max(norm, 1e-300))


def check_arm_config(check: str, layer: int) -> ABFTConfig:
    """The config of a check arm: ``check`` (an attention op or a linear layer's ``role:op``)
    at ``layer`` alone, every step, ``skip_step`` (as a plan ships it)."""
    scope = "all_linear" if linear_parts(check) else "attention"
    return ABFTConfig(schedule=((layer, check, 1),), policy="skip_step", scope=scope)


def reference(
    family: str,
    model: nn.Module,
    batches: list[dict[str, Tensor]],
    lr: float,
    layer: int,
    backend: str = "eager",
) -> TrialSetup:
    """Run the fault-free training once (on ``backend``) and keep what trials compare against."""
    from attnchecker.models.factory import OwnModel
    from attnchecker.models.protect import protect_, unprotect_

    example = (batches[0]["input_ids"][:1],) if isinstance(model, OwnModel) else None
    probe = copy.deepcopy(model)
    handle = protect_(probe, ABFTConfig(ops=(), backend=backend), example=example)
    seen: dict[str, Tensor] = {}
    detach = _observe(probe, handle, layer, seen)
    losses, _, _, _ = _train(probe, batches, lr, seed=0)
    for d in detach:
        d.remove()
    unprotect_(probe)
    params = {n: p.detach().clone() for n, p in probe.named_parameters()}
    return TrialSetup(family, model, batches, lr, losses, params, seen, backend, example)
