"""Check the controller's claims by simulation: train under sampled faults, count what died.

``simulate`` trains the campaign's model (its family, size, batch and sequence length, fresh
random batches each step) for ``steps`` steps under faults drawn at the given rate: at every
step, each profiled site i gets Poisson(lambda_i) faults, of a kind drawn from the rate's
distribution and a pattern from the campaign's, injected at the site's GEMM as in a campaign.
The model is protected by the chosen schedule (``policy="warn"``, as the campaign's protected
arm). A step after which the loss or a parameter is not finite is a non-trainable event: it is
counted and the model and optimizer go back to their state three steps earlier (a campaign
trial watches three steps after its fault), and training goes on. Then the chosen
configuration and the plain model (SDPA) are timed alternately on clean steps, as the cost
profile times its arms.

``inside`` says whether the count lies in the predicted interval: the Poisson quantiles
(2.5% / 97.5%) at the low and high ends of the predicted mean (``verdict``: below it is the
model's conservative side, above it a broken claim); likewise for the overhead.
:func:`frontier` does this for several budgets (the report plots it).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnchecker.adaptive.bench import median_interval
from attnchecker.adaptive.controller import Choice, FaultRate, choose, risk_of, sites
from attnchecker.adaptive.profile import CostProfile, Estimate, VulnerabilityProfile
from attnchecker.errors import ConfigError

__all__ = ["Simulation", "frontier", "poisson_interval", "simulate"]


def poisson_interval(low_mean: float, high_mean: float, tail: float = 0.025) -> tuple[int, int]:
    """The counts [a, b]: P(N < a) <= tail at mean ``low_mean``, P(N > b) <= tail at
    ``high_mean`` (N ~ Poisson)."""

    def quantile(mean: float, q: float) -> int:
        k, term = 0, math.exp(-mean)
        cdf = term
        while cdf < q:
            k += 1
            term *= mean / k
            cdf += term
        return k

    lo = 0 if low_mean <= 0 else quantile(low_mean, tail)
    return lo, quantile(high_mean, 1 - tail)


def _cdf(k: int, mean: float) -> float:
    term = cdf = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        cdf += term
    return cdf


def count_interval(k: int, tail: float = 0.025) -> tuple[float, float]:
    """The exact (Garwood) interval of a Poisson mean from an observed count k: the means at
    which P(N >= k) and P(N <= k) are ``tail``."""

    def crossing(f, target: float) -> float:  # f increases with the mean
        lo, hi = 0.0, 10.0 + 10.0 * k
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else crossing(lambda m: 1 - _cdf(k - 1, m), tail)  # P(N >= k) = tail
    return low, crossing(lambda m: 1 - _cdf(k, m), 1 - tail)  # P(N <= k) = tail


@dataclass(frozen=True)
class Simulation:
    budget: float | None
    checks: tuple[tuple[int, str, int], ...]
    steps: int
    faults: int
    events: int  # non-trainable steps
    predicted_events: Estimate  # expected count over the run
    events_interval: tuple[int, int]  # where the count should fall
    overhead: Estimate  # measured, fraction of the plain step
    predicted_overhead: Estimate
    seconds: float

    @property
    def inside(self) -> bool:
        return self.events_interval[0] <= self.events <= self.events_interval[1]

    @property
    def verdict(self) -> str:
        """inside; below (fewer than predicted: the model's conservative side); ABOVE (more:
        the claim broke)."""
        if self.inside:
            return "inside"
        return "below" if self.events < self.events_interval[0] else "ABOVE"

    @property
    def overhead_inside(self) -> bool:
        return self.predicted_overhead.low <= self.overhead.point <= self.predicted_overhead.high

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Simulation:
        est = ("predicted_events", "overhead", "predicted_overhead")
        return cls(**{k: d[k] for k in ("budget", "steps", "faults", "events", "seconds")},
                   checks=tuple(tuple(c) for c in d["checks"]),
                   events_interval=tuple(d["events_interval"]),
                   **{k: Estimate(*d[k]) for k in est})  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"inside": self.inside, "verdict": self.verdict,
                               "overhead_inside": self.overhead_inside}  # fmt: skip


def _plan(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, steps: int, seed: int):
    from attnchecker.inject.plan import Fault, FaultPlan

    ss = sites(vuln, cost, rate)
    kinds = rate.kinds or {k: 1 / len(vuln.kinds) for k in vuln.kinds}
    names, probs = list(kinds), torch.tensor(list(kinds.values()), dtype=torch.float64)
    patterns = vuln.setup.get("patterns", ["0D"])
    g = torch.Generator().manual_seed(seed)
    lam = torch.tensor([s.faults for s in ss], dtype=torch.float64)
    counts = torch.poisson(lam.expand(steps, -1).contiguous(), generator=g).long()  # (steps, n)
    faults = []
    for step, site in counts.nonzero().tolist():
        for _ in range(int(counts[step, site])):
            kind = names[int(torch.multinomial(probs, 1, generator=g))]
            pattern = patterns[int(torch.randint(len(patterns), (1,), generator=g))]
            s = ss[site]
            faults.append(Fault(step=step + 1, site=s.op, kind=kind, pattern=pattern,
                                layer=s.layer, size=(2, 3)))  # fmt: skip
    return FaultPlan(tuple(faults), seed)


def _model(vuln: VulnerabilityProfile, seed: int):
    from attnchecker.models.tiny import build

    setup = vuln.setup
    model = build(vuln.family, setup.get("size", "tiny"), seed=setup.get("seed", 0),
                  max_len=max(64, setup.get("seq_len", 32)))  # fmt: skip
    model.config.use_cache = False
    model.train()
    return model


def _finite(loss: torch.Tensor, model: torch.nn.Module) -> bool:
    params = model.parameters()
    return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p).all()) for p in params)


def simulate(
    vuln: VulnerabilityProfile,
    cost: CostProfile,
    rate: FaultRate,
    choice: Choice,
    *,
    steps: int = 400,
    seed: int = 0,
    timing_reps: int = 9,
    budget: float | None = None,
) -> Simulation:
    """Train ``steps`` steps of the campaign's model under faults at ``rate`` with ``choice``'s
    schedule; count the non-trainable events and time the overhead (module docstring)."""
    import warnings

    from attnchecker.inject.injector import Injector
    from attnchecker.models.families import TABLE
    from attnchecker.models.protect import protect_

    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    t_start = time.perf_counter()
    setup = vuln.setup
    B, L, lr = setup.get("batch", 4), setup.get("seq_len", 32), setup.get("lr", 1e-3)
    plain = _model(vuln, seed)
    model = copy.deepcopy(plain)
    config = choice.config.replace(policy="warn")
    handle = protect_(model, config if choice.checks else config.replace(ops=()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    plan = _plan(vuln, cost, rate, steps, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ring: list[tuple[dict, dict]] = []
    events, step = 0, 0
    with Injector(model, plan, step_fn=lambda: step), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, steps + 1):  # noqa: B007 (the injector reads it)
            now = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            ring = [*ring[-2:], now]
            ids = torch.randint(3, 128, (B, L), generator=g)
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            handle.drain()
            if not _finite(loss.detach(), model):
                events += 1
                params, state = ring[0]
                model.load_state_dict(params)
                opt.load_state_dict(copy.deepcopy(state))  # it keeps the tensors it is given
                ring = ring[:1]
    plain.load_state_dict(model.state_dict())  # the same weights: values change the speed
    if TABLE[vuln.family].sdpa:  # (trained weights run slower on a CPU than fresh ones)
        plain.set_attn_implementation("sdpa")
    overhead = _overhead(plain, model, choice, B, L, timing_reps, seed) if choice.checks else (
        Estimate(0.0, 0.0, 0.0))  # fmt: skip
    mean = risk_of(vuln, cost, rate, choice.checks).scaled(steps / 1e6)
    return Simulation(
        budget, choice.checks, steps, len(plan.faults), events, mean,
        poisson_interval(mean.low, mean.high), overhead, choice.overhead,
        time.perf_counter() - t_start,
    )  # fmt: skip


def _overhead(plain, model, choice: Choice, B: int, L: int, reps: int, seed: int) -> Estimate:
    """Median over alternated clean steps of t_protected / t_plain - 1, with its interval: the
    steps of the cost profile (forward, backward, AdamW; the protected one drains), timed as it
    times them (:func:`~attnchecker.adaptive.bench.alternate`), whole periods per round."""
    from attnchecker.adaptive.bench import alternate, stepper

    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(3, 128, (B, L), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    fns = {
        name: stepper(m, m, inputs, "fp32", "cpu")
        for name, m in (("plain", plain), ("protected", model))
    }
    k = max(1, choice.config.period)  # whole periods, of at least three steps, per round
    times = alternate(fns, reps, k * max(1, math.ceil(3 / k)))
    ratios = [a / b - 1 for a, b in zip(times["protected"], times["plain"], strict=True)]
    if len(ratios) < 3:
        return Estimate(*[statistics.median(ratios)] * 3)
    return median_interval(ratios)


def frontier(
    vuln: VulnerabilityProfile,
    cost: CostProfile,
    rate: FaultRate,
    budgets: list[float],
    *,
    steps: int = 400,
    seed: int = 0,
    timing_reps: int = 9,
    progress: bool = False,
) -> list[Simulation]:
    """One simulation per budget (and one unprotected, budget 0) at ``rate``."""
    from attnchecker.inject.campaign import Progress

    out = []
    with Progress(len(budgets) + 1, progress) as advance:
        for budget in [0.0, *budgets]:
            if budget == 0:
                choice = choose(vuln, cost, FaultRate(0.0, rate.per, rate.kinds), budget=0.0)
            else:
                choice = choose(vuln, cost, rate, budget=budget)
            out.append(simulate(vuln, cost, rate, choice, steps=steps, seed=seed,
                                timing_reps=timing_reps, budget=budget))  # fmt: skip
            advance()
    return out
