"""The controller's knapsack with interactions (:mod:`attnchecker.adaptive.controller` derives
the model): which checks run on which steps, a site's risk under them, and the greedy choice
of checks by risk removed per cost given the checks already taken."""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol

from attnchecker.adaptive.profile import Estimate

__all__ = ["PERIODS", "Active", "Greedy", "Site", "active_checks", "site_risk"]

PERIODS = (2, 4, 8, 16, 32, 64)
"""The periods (every k steps) a schedule may use, one per schedule."""


class Site(Protocol):
    """What the knapsack reads of a site (:class:`attnchecker.adaptive.controller.Site`)."""

    layer: int
    op: str
    faults: float  # per step
    cost: Estimate  # per step, a fraction of the plain step

    def rate(self, on: frozenset[tuple[int, str]]) -> Estimate: ...

    def covers(self, layer: int, op: str) -> bool: ...


Active = list[tuple[float, frozenset[tuple[int, str]]]]  # (share of steps, (layer, op) that run)


def active_checks(ss: list[Site], f: dict[int, float]) -> Active:
    """(share of the steps, the checks that run, as (layer, op)) when the sites are checked on
    fractions ``f`` of the steps (1 / every; periodic checks run on the same steps, those whose
    count is a multiple of their period, as :class:`Schedule` runs them)."""
    periods = {(ss[i].layer, ss[i].op): round(1 / v) for i, v in f.items() if v}
    n = math.lcm(*periods.values()) if periods else 1
    shares = Counter(frozenset(c for c, k in periods.items() if t % k == 0) for t in range(n))
    return [(c / n, on) for on, c in shares.items()]


def site_risk(s: Site, active: Active, j: int) -> float:
    """Expected non-trainable events per step from faults at ``s`` (end j: 0 point, 1 low, 2
    high) while the checks of ``active`` run (:meth:`Site.rate`)."""
    return s.faults * sum(w * s.rate(on)[j] for w, on in active)


class Greedy:
    """The knapsack, greedily: take the check that removes the most risk per cost, given the
    checks already taken (a check's gain shrinks when another check already covers its
    faults), every step while checks fit, then every k steps; for each k of :data:`PERIODS`
    (one k per schedule), keep the best. Decisions use end ``end`` of the risk intervals. A
    check's gain is summed over the sites it is credited at (:meth:`Site.covers`) only."""

    def __init__(self, ss: list[Site], end: int, among: frozenset[int] | None = None) -> None:
        self.ss, self.end = ss, end
        self.among = frozenset(range(len(ss))) if among is None else among  # checks it may take
        self.covered = [[j for j, t in enumerate(ss) if t.covers(s.layer, s.op)] for s in ss]

    def gain(self, i: int, v: float, f: dict[int, float]) -> float:
        """Risk per step removed by checking site i on a fraction v of the steps beside f."""
        before, after = active_checks(self.ss, f), active_checks(self.ss, {**f, i: v})
        risk = lambda j, active: site_risk(self.ss[j], active, self.end)
        return sum(risk(j, before) - risk(j, after) for j in self.covered[i])

    def _gains(self, f: dict[int, float], v: float) -> dict[int, float]:
        return {i: self.gain(i, v, f) for i in sorted(self.among) if i not in f}

    def _best(self, gains: dict[int, float], v: float, left: float) -> int | None:
        """The check with the most risk removed per cost whose cost (upper end) at fraction v
        is at most ``left``; None when none fits and removes risk."""
        fits = [i for i, g in gains.items() if g > 0 and self._dear(i) * v <= left]
        return max(fits, default=None,
                   key=lambda i: (gains[i] / max(self.ss[i].cost.point, 1e-9), -i))  # fmt: skip

    def _add(self, f: dict[int, float], i: int, v: float, gains: dict[int, float]) -> None:
        f[i] = v
        del gains[i]
        touched = set(self.covered[i])  # the gains that change: checks credited there too
        for other in gains:
            if touched.intersection(self.covered[other]):
                gains[other] = self.gain(other, v, f)

    def _dear(self, i: int) -> float:
        return max(self.ss[i].cost.high, 0.0)

    def total(self, f: dict[int, float]) -> float:
        active = active_checks(self.ss, f)
        return sum(site_risk(s, active, self.end) for s in self.ss)

    def for_budget(self, room: float) -> dict[int, float]:
        """The schedule with the least risk whose checks cost at most ``room`` at the upper
        ends of their cost intervals."""
        best, best_risk = {}, float("inf")
        for k in (1, *PERIODS):
            f: dict[int, float] = {}
            left = room
            for v in (1.0,) if k == 1 else (1.0, 1 / k):
                gains = self._gains(f, v)
                while (i := self._best(gains, v, left)) is not None:
                    left -= self._dear(i) * v
                    self._add(f, i, v, gains)
            if (risk := self.total(f)) < best_risk - 1e-18:
                best, best_risk = f, risk
        return best

    def for_target(self, target: float) -> dict[int, float] | None:
        """The cheapest schedule (over the periods) with risk <= target; None if none."""
        best, best_cost = None, float("inf")
        for k in (1, *PERIODS):
            f: dict[int, float] = {}
            risk, gains = self.total(f), self._gains(f, 1.0)
            while risk > target and (i := self._best(gains, 1.0, math.inf)) is not None:
                if k > 1 and risk - self.gain(i, 1 / k, f) <= target:
                    f[i] = 1 / k  # the last check, every k steps, is enough
                    risk = self.total(f)
                    break
                risk -= gains[i]
                self._add(f, i, 1.0, gains)
            if risk > target * (1 + 1e-12):
                return None
            c = sum(v * self.ss[i].cost.point for i, v in f.items())
            if c < best_cost:
                best, best_cost = f, c
        return best
