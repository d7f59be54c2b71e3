"""Seeded, declarative fault plans: which fault, where, when.

A :class:`Fault` names a *site* and a *step*; where inside the site's tensor it lands is given by
a pattern and optional coordinates, and coordinates left out are drawn from the plan's seed when
the fault fires, so the same plan on the same model always hits the same elements. Sites:

- an attention site of a layer: ``q``, ``k``, ``v``, ``scores``, ``probs``, ``context``, ``out``;
- ``linear:<role>:<op>``: a GEMM of a linear layer outside attention, named by its role in the
  block of ``layer`` (``linear:mlp.c_fc:y``; a layer outside the blocks by its whole name, layer
  -1: ``linear:lm_head:dw``); ``op`` its output ``y`` or its backward's ``dx`` / ``dw``, placed
  between the GEMM and its check (``scope="all_linear"``) like an attention site;
- ``module:<qualified name>``: the output of any module (``module:bert.encoder.layer.0.output``);
- ``grad:<parameter name>``: a parameter's gradient during backward;
- ``optim:<parameter name>:<state key>``: an optimizer state tensor (``exp_avg``,
  ``exp_avg_sq``, ``momentum_buffer``) or, as key ``param``, the parameter itself, just before
  step s's update (in a step pre-hook: the update of step s reads the faulty value; a state
  tensor exists from the optimizer's first step, so a fault at step 1 on one does not fire);
  ``optim:<parameter name>:<key>:written``: the same tensor just after step s's update (a wrong
  value the update wrote);
- ``kernel:<site>``: a GEMM inside the fused kernels of a layer (``ABFTConfig(backend=
  "triton")``): ``s``, ``pv`` in the forward, ``st``, ``dpt``, ``dv``, ``dk``, ``sq``, ``dp``,
  ``dq`` in the backward (:data:`attnchecker.kernels.flash.SITES`); patterns 0D, 1R, 1C;
  ``persistent`` faults hit every recomputation too (else the first only).

A ``persistent`` fault (any site) fires in every forward pass of its step and that pass's
backward, so that a step replayed on its batch (``policy="replay"``) meets it again: a stuck
unit, not a transient upset (which fires once).

Steps count the model's forward passes from 1 (one per training step).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field

import torch

from attnchecker.attention.config import ALL_OPS, LINEAR_OPS, OPS
from attnchecker.attention.ops import linear_parts
from attnchecker.errors import ConfigError
from attnchecker.inject.kinds import KERNEL_MODES, FaultKind

__all__ = ["Fault", "FaultPattern", "FaultPlan", "PlanBuilder", "check_op", "fault_site"]

SCHEMA_VERSION = 1


class FaultPattern(enum.StrEnum):
    """Which elements of the (last two dims) matrix a fault touches."""

    D0 = "0D"  # one element
    R1 = "1R"  # a whole row
    C1 = "1C"  # a whole column
    D2 = "2D"  # a block of ``size`` rows x columns
    RANDOM = "random"  # size[0] * size[1] random elements


def check_op(site: str) -> str:
    """The check that sees a fault at ``site`` (a schedule's and the controller's op): an
    attention site is its own op, ``linear:mlp.c_fc:y`` is ``mlp.c_fc:y``."""
    return site.removeprefix("linear:") if site.startswith("linear:") else site


def fault_site(op: str) -> str:
    """The fault site of a check ``op`` (:func:`check_op`'s inverse)."""
    return f"linear:{op}" if linear_parts(op) is not None else op


@dataclass(frozen=True, kw_only=True)
class Fault:
    step: int
    site: str
    kind: FaultKind = FaultKind.EXPONENT_FLIP
    pattern: FaultPattern = FaultPattern.D0
    layer: int = 0  # attention, linear and kernel sites (linear: -1 outside the blocks)
    batch: int | None = None  # leading coordinates (batch, head); None: drawn
    head: int | None = None
    row: int | None = None  # matrix coordinates; None: drawn
    col: int | None = None
    size: tuple[int, int] = (2, 2)
    bit: int | None = None  # for bit_flip
    value: float | None = None  # for near_inf, scale, random
    persistent: bool = False  # every pass of its step (a replay too); kernels: recomputations

    def __post_init__(self) -> None:
        for name, kinds in (("kind", FaultKind), ("pattern", FaultPattern)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kinds(value))
            except ValueError:
                raise ConfigError(
                    f"unknown fault {name} {value!r}; choose from {[e.value for e in kinds]}"
                ) from None
        object.__setattr__(self, "size", tuple(self.size))
        if self.step < 1:
            raise ConfigError(f"step counts forward passes from 1, got {self.step}")
        prefix = self.site.split(":", 1)[0]
        families = ("linear", "module", "grad", "optim", "kernel")
        if self.site not in ALL_OPS and prefix not in families:
            raise ConfigError(
                f"unknown site {self.site!r}: use one of {list(ALL_OPS)} or "
                "'linear:<role>:<op>', 'module:<name>', 'grad:<param>', "
                "'optim:<param>:<state key>', 'kernel:<site>'"
            )
        if prefix == "optim":
            parts = self.site.split(":")
            written = parts[3:] in ([], ["written"])
            if len(parts) not in (3, 4) or not all(parts[1:3]) or not written:
                raise ConfigError(
                    f"an optim site is 'optim:<param>:<state key or param>' (optionally "
                    f"':written': after the update), got {self.site!r}"
                )
        if prefix == "linear" and linear_parts(self.site.split(":", 1)[1]) is None:
            raise ConfigError(
                f"a linear site is 'linear:<role>:<op>' with op one of {list(LINEAR_OPS)} "
                f"(linear:mlp.c_fc:y), got {self.site!r}"
            )
        if prefix == "kernel":
            from attnchecker.kernels import KERNEL_SITES

            name = self.site.split(":", 1)[1]
            if name not in KERNEL_SITES:
                raise ConfigError(f"unknown kernel site {name!r}; choose from {list(KERNEL_SITES)}")
            if self.pattern not in (FaultPattern.D0, FaultPattern.R1, FaultPattern.C1):
                raise ConfigError(f"kernel sites take patterns 0D, 1R, 1C, not {self.pattern}")
            if self.kind not in KERNEL_MODES:
                raise ConfigError(
                    f"kernel sites cannot express fault kind {self.kind!s}; they take "
                    f"{sorted(str(k) for k in KERNEL_MODES)}"
                )
        if self.kind is FaultKind.BIT_FLIP and self.bit is None:
            raise ConfigError("a bit_flip fault needs bit= (0 is the least significant bit)")

    @property
    def family(self) -> str:
        """attention, linear, module, grad, optim or kernel."""
        return "attention" if self.site in ALL_OPS else self.site.split(":", 1)[0]

    def index(self, shape: torch.Size, generator: torch.Generator) -> tuple:
        """The index of the elements this fault edits in a tensor of ``shape``.

        The matrix is the last two dims (a 1-D tensor is one row); leading dims take ``batch``
        and ``head`` in that order, drawn when None; so do missing row / column coordinates.
        """

        def draw(n: int) -> int:
            return int(torch.randint(0, n, (1,), generator=generator))

        if len(shape) == 1:
            return (self._matrix(1, shape[0], generator)[1],)
        lead = []
        for i, n in enumerate(shape[:-2]):
            given = (self.batch, self.head)[i] if i < 2 else None
            lead.append(draw(n) if given is None else given)
        return (*lead, *self._matrix(shape[-2], shape[-1], generator))

    def _matrix(self, M: int, N: int, generator: torch.Generator) -> tuple:
        def draw(n: int) -> int:
            return int(torch.randint(0, n, (1,), generator=generator))

        row = draw(M) if self.row is None else self.row
        col = draw(N) if self.col is None else self.col
        h, w = min(self.size[0], M), min(self.size[1], N)
        if self.pattern is FaultPattern.D0:
            return row, col
        if self.pattern is FaultPattern.R1:
            return row, slice(None)
        if self.pattern is FaultPattern.C1:
            return slice(None), col
        if self.pattern is FaultPattern.D2:
            r, c = min(row, M - h), min(col, N - w)
            return slice(r, r + h), slice(c, c + w)
        flat = torch.randperm(M * N, generator=generator)[: h * w]
        return flat // N, flat % N

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["kind"], d["pattern"] = self.kind.value, self.pattern.value
        return d


@dataclass(frozen=True)
class FaultPlan:
    """An ordered set of faults and the seed that draws their free coordinates."""

    faults: tuple[Fault, ...]
    seed: int = 0
    schema_version: int = field(default=SCHEMA_VERSION)

    @staticmethod
    def builder(seed: int = 0) -> PlanBuilder:
        return PlanBuilder(seed)

    def generator(self, i: int) -> torch.Generator:
        """The generator of fault i: independent of the others and of global RNG state."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + i)

    @classmethod
    def sample(
        cls,
        n: int,
        seed: int,
        *,
        sites: tuple[str, ...] = OPS,
        kinds: tuple[str, ...] = (FaultKind.EXPONENT_FLIP,),
        patterns: tuple[str, ...] = (FaultPattern.D0,),
        layers: tuple[int, ...] = (0,),
        steps: tuple[int, ...] = (1,),
    ) -> FaultPlan:
        """``n`` faults drawn uniformly over the given choices (same seed, same plan)."""
        g = torch.Generator().manual_seed(seed)

        def pick(options: tuple):
            return options[int(torch.randint(0, len(options), (1,), generator=g))]

        faults = tuple(
            Fault(
                step=pick(steps),
                site=pick(sites),
                kind=pick(kinds),
                pattern=pick(patterns),
                layer=pick(layers),
            )
            for _ in range(n)
        )
        return cls(faults, seed)

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema_version": self.schema_version,
                "seed": self.seed,
                "faults": [f.to_dict() for f in self.faults],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        """A plan from :meth:`to_json`'s text; :class:`ConfigError` says what is wrong with a
        malformed one (not JSON, a missing field, an unknown key, a bad value)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"a fault plan must be JSON: {e.msg} at line {e.lineno}, column {e.colno}"
            ) from None
        if not isinstance(d, dict) or not isinstance(d.get("faults"), list) or "seed" not in d:
            raise ConfigError('a fault plan is {"seed": <int>, "faults": [{...}, ...]}')
        fields = {f.name for f in dataclasses.fields(Fault)}
        for i, f in enumerate(d["faults"]):
            if not isinstance(f, dict):
                raise ConfigError(f"fault {i} of the plan is not an object: {f!r}")
            if unknown := sorted(set(f) - fields):
                raise ConfigError(f"fault {i}: unknown keys {unknown}; known: {sorted(fields)}")
            if missing := sorted(k for k in ("step", "site") if k not in f):
                raise ConfigError(f"fault {i}: missing {missing}")
        return cls(
            tuple(Fault(**f) for f in d["faults"]),
            d["seed"],
            d.get("schema_version", SCHEMA_VERSION),
        )


class PlanBuilder:
    """Fluent: ``FaultPlan.builder(seed).at(3).site("scores").kind("nan").add().build()``.

    Settings carry over from one ``add()`` to the next, so a series of similar faults reads short.
    """

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._faults: list[Fault] = []
        self._next: dict[str, object] = {"step": 1, "site": "scores"}

    def at(self, step: int) -> PlanBuilder:
        self._next["step"] = step
        return self

    def site(self, site: str, *, layer: int | None = None) -> PlanBuilder:
        self._next["site"] = site
        if layer is not None:
            self._next["layer"] = layer
        return self

    def kind(self, kind: str, *, bit: int | None = None, value: float | None = None) -> PlanBuilder:
        self._next.update(kind=kind, bit=bit, value=value)
        return self

    def persistent(self) -> PlanBuilder:
        """The next fault is persistent: it fires in every pass of its step (a replay too)."""
        self._next["persistent"] = True
        return self

    def pattern(self, pattern: str, *, size: tuple[int, int] | None = None) -> PlanBuilder:
        self._next["pattern"] = pattern
        if size is not None:
            self._next["size"] = size
        return self

    def position(self, *, batch: int | None = None, head: int | None = None, row: int | None = None,
                 col: int | None = None) -> PlanBuilder:  # fmt: skip
        self._next.update(batch=batch, head=head, row=row, col=col)
        return self

    def add(self, **overrides: object) -> PlanBuilder:
        self._faults.append(Fault(**{**self._next, **overrides}))
        return self

    def build(self) -> FaultPlan:
        return FaultPlan(tuple(self._faults), self._seed)
