"""``ABFTConfig``: what protected attention checks and what it does about errors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnchecker.attention.impl import IMPLS as CHECK_IMPLS
from attnchecker.attention.ops import ALL_OPS, GRAD_OPS, LINEAR_OPS, OPS, linear_parts, op_key
from attnchecker.attention.schedule import Schedule
from attnchecker.errors import ConfigError

__all__ = [
    "ALL_OPS", "BACKENDS", "GRAD_OPS", "INVARIANTS", "LINEAR_OPS", "OPS", "POLICIES", "SCOPES",
    "ABFTConfig",
]  # fmt: skip

SCOPES = ("attention", "all_linear")
POLICIES = ("raise", "skip_step", "warn", "replay")
MODES = ("naive", "passing")
BACKENDS = ("eager", "sdpa", "triton", "auto")
INVARIANTS = ("norm", "update")
"""Checks beyond the GEMMs (``ABFTConfig.invariants``): the normalisations' outputs
(:mod:`attnchecker.models.norms`) and the optimizer's update (:mod:`attnchecker.recovery.
update_check`, run by :func:`attnchecker.guard`)."""


@dataclass(frozen=True, kw_only=True)
class ABFTConfig:
    """How :func:`attnchecker.protect_` protects a model. Defaults check everything, every step.

    - ``ops``: which operations are verified (a subset of :data:`ALL_OPS`: the forward's
      :data:`OPS` and the backward's :data:`GRAD_OPS`); the others still expose their named
      sites, so an empty tuple gives an instrumented but unprotected model.
    - ``scope``: ``"attention"`` checks the attention modules (their projections and core);
      ``"all_linear"`` also every other ``nn.Linear`` / ``Conv1D`` of the model (MLP, LM head,
      classifier), forward and backward (:data:`LINEAR_OPS`: the output ``y`` when ``ops`` has
      a forward op, ``dx`` and ``dw`` when it has a backward op; ``ops=()`` checks none).
    - ``layers``: indices of the attention layers to protect (None: all).
    - ``mode``: ``"naive"`` computes every check's reference and bound from its own operands;
      ``"passing"`` takes the context check's reference from the V projection check (V's row
      sums from X and W, with that check's error bound: see
      :mod:`~attnchecker.attention.handoff`). Passing saves one reduction over V but its bound
      is loose: measured 1000x less sensitive in fp32 (``benchmarks/check_sensitivity.py``),
      which is why ``"naive"`` is the default.
    - ``policy``: what :meth:`ProtectionHandle.drain` does about an uncorrectable error:
      ``raise``, ``warn``, ``skip_step`` (the update is skipped: :func:`attnchecker.guard`) or
      ``replay`` (the step is recomputed on the same batch with the same random state, and
      skipped only when the replay meets the error again: :func:`attnchecker.replay`).
    - ``max_rows``: token rows of a projection output that may be recomputed per call (covers
      whole-row errors and 2D blocks spanning up to this many tokens).
    - ``max_heads``: (batch, head) matrices of scores / probabilities / context that may be
      recomputed per call (any pattern inside them).
    - ``tolerance_scale``: multiplies every derived tolerance (>= 1 makes checks less sensitive).
    - ``schedule``: per-layer checks instead of ``ops`` x ``layers``: ``(layer, op, every)``
      triples, ``every`` = 1 for every step, k for every k-th step (one k per config, so a
      compiled model holds two graphs, the checked and the unchecked variant, and never
      recompiles); an op of a layer not listed is not checked (its sites remain, for
      fault injection). The period counts
      :meth:`~attnchecker.models.handle.ProtectionHandle.drain` calls (one per step in
      ``attnchecker.train``, the Trainer callback and ``GuardedOptimizer``).
      ``attnchecker.adaptive.controller.choose(...).config`` builds one. With
      ``scope="all_linear"`` an entry may name a linear layer's check as ``role:op``
      (:func:`~attnchecker.attention.ops.linear_op`: ``(0, "mlp.c_fc:y", 1)``; layer -1 for a
      layer outside the blocks, ``(-1, "lm_head:dw", 1)``); only the linear layers named are
      then instrumented.
    - ``backend``: ``"eager"`` runs the checked eager attention (materialised scores,
      checksums that see any error above rounding in S, P and O); ``"sdpa"`` the SDPA route
      (:mod:`~attnchecker.attention.sdpa_core`): the backend's own SDPA kernel, checked by the
      invariants of what it returns (no L x L tensor; bounds that see extreme errors in the
      forward, exact sums of dV and dK in the backward); ``"triton"`` the fused flash kernels
      with their checks inside (:mod:`attnchecker.kernels`); the last two fall back to the eager
      engine, with a warning once, for a call they do not cover (soft-capping; for the fused
      kernels attention dropout in training; for the route attention dropout under
      torch.compile). ``"auto"`` (the default) is the SDPA route on CUDA where the model's
      attention goes through transformers' attention interface or SDPA and the route passes a
      self-test there, eager otherwise (on a CPU: the eager core's checksums see more). The
      projections are checked by the same hooks in every backend.
    - ``check_impl``: how the projections' checks (forward and backward; with
      ``scope="all_linear"`` every linear layer's) and the core's backward checks run from
      eager code:
      ``"compiled"``, each check one ``torch.compile``d region (a few fused kernels; compiled
      once per dtype and layout, seconds each, on first use); ``"eager"``, its aten ops;
      ``"triton"``, every GEMM check (the projections' forward checks, the linear layers' dX
      and dW) as registered Triton ops (:mod:`attnchecker.kernels.projection_check`,
      :mod:`attnchecker.kernels.gemm_check`: two or three launches a check, the repair
      waiting for a device flag; rows detect, columns locate, every flagged row repaired) on
      CUDA or in Triton's interpreter, the other checks compiled; ``"auto"``, ``"triton"`` on
      CUDA and elsewhere compiled where that measured faster and inductor can build, unless
      the environment variable :data:`attnchecker.attention.impl.ENV` says otherwise
      (:mod:`attnchecker.attention.impl`, resolved once per module at ``protect_``). Same
      tolerances; inside a model the user compiles, the registered ops stay ops (one extern
      call each) and the other checks are traced inline as regions.
    - ``sampled_rows``: on the SDPA route, query rows per (batch, head) and call recomputed in
      fp32 and compared per element with the kernel's O and LSE (backward: dQ of those rows,
      dK and dV of as many key rows per K/V head): what the route's invariants cannot see (a
      lowered score, an error in P or O inside V's range) is seen in a sampled row, at ~s / L
      of attention's cost; a given row is sampled with probability s / L per call
      (:func:`attnchecker.kernels.sdpa_sample.coverage`, ``summary()["per_module"][...]
      ["sampled"]``). Calls with attention dropout are not sampled. Default 0 (off): 2 is
      0.05% of attention's FLOPs at L = 4096 (a fault that stays on one row is caught in ~L / 2
      calls of its layer on average), but on CUDA the check runs as ~200 small torch ops a
      layer until it has a kernel of its own: +5.3 points modelled at Llama-8B widths
      (``benchmarks/gpu_layer_model.py``, issue 55).
    - ``invariants``: checks beyond the GEMMs, where faulty GPUs' CUDA cores fail (a subset of
      :data:`INVARIANTS`): ``"norm"``, every RMSNorm / LayerNorm output element against its
      row recomputed from the input (a per-element rounding bound; the worst ``max_rows`` rows
      of a call repaired by the module's own forward, on the device); ``"update"``, the
      optimizer's new state and parameters against row checksums of the update
      (:func:`attnchecker.guard` runs it: AdamW, Adam, SGD; one wrong element a row located and
      repaired after the step). Default none: their cost on a GPU is modelled, not measured
      (``docs/invariants.md``).
    - ``strict``: a model of one's own with attention protect_ cannot route (written by hand,
      ``flex_attention``, ...; :mod:`attnchecker.models.sdpa`) is refused (True), or protected
      at the SDPA calls it has, with a warning and ``summary()["attention"]`` naming the rest
      (False).
    """

    ops: tuple[str, ...] = ALL_OPS
    scope: str = "attention"
    layers: tuple[int, ...] | None = None
    mode: str = "naive"
    policy: str = "raise"
    max_rows: int = 4
    max_heads: int = 2
    tolerance_scale: float = 1.0
    backend: str = "auto"
    check_impl: str = "auto"
    schedule: tuple[tuple[int, str, int], ...] | None = None
    strict: bool = True
    sampled_rows: int = 0
    invariants: tuple[str, ...] = ()

    @property
    def period(self) -> int:
        """The k of the schedule's every-k-steps checks (1: none)."""
        return Schedule.of(self).period

    def layer_ops(self, layer: int, step: int | None = None) -> frozenset[str]:
        """The ops checked in ``layer`` (at ``step``, counting from 1, when given): see
        :meth:`~attnchecker.attention.schedule.Schedule.layer_ops`."""
        return Schedule.of(self).layer_ops(layer, step)

    def __post_init__(self) -> None:
        if isinstance(self.ops, str):
            raise ConfigError(f"ops must be a tuple of op names, e.g. ops=({self.ops!r},)")
        unknown = sorted(set(self.ops) - set(ALL_OPS))
        if unknown:
            raise ConfigError(f"unknown ops {unknown}; choose from {list(ALL_OPS)}")
        if self.scope not in SCOPES:
            raise ConfigError(f"scope must be one of {list(SCOPES)}, got {self.scope!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.check_impl not in CHECK_IMPLS:
            raise ConfigError(
                f"check_impl must be one of {list(CHECK_IMPLS)}, got {self.check_impl!r}"
            )
        if isinstance(self.invariants, str):
            raise ConfigError(f"invariants must be a tuple, e.g. invariants=({self.invariants!r},)")
        if unknown := sorted(set(self.invariants) - set(INVARIANTS)):
            raise ConfigError(f"unknown invariants {unknown}; choose from {list(INVARIANTS)}")
        object.__setattr__(self, "invariants", tuple(i for i in INVARIANTS if i in self.invariants))
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        for name in ("max_rows", "max_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.sampled_rows, int) or self.sampled_rows < 0:
            raise ConfigError(
                f"sampled_rows must be a non-negative integer (0 turns the sampled check off), "
                f"got {self.sampled_rows!r}"
            )
        if not self.tolerance_scale >= 1.0:
            raise ConfigError(
                f"tolerance_scale must be >= 1 (the derived tolerance is already a bound on "
                f"rounding error), got {self.tolerance_scale!r}"
            )
        if self.layers is not None:
            if any(not isinstance(i, int) or i < 0 for i in self.layers):
                raise ConfigError(f"layers must be non-negative layer indices, got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        object.__setattr__(self, "ops", tuple(op for op in ALL_OPS if op in self.ops))
        if self.schedule is not None:
            object.__setattr__(self, "schedule", self._checked_schedule())

    def _checked_schedule(self) -> tuple[tuple[int, str, int], ...]:
        if self.layers is not None or self.ops != ALL_OPS:
            raise ConfigError("give either a schedule or ops / layers, not both")
        entries = []
        for entry in self.schedule:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 3):
                raise ConfigError(f"schedule entries are (layer, op, every), got {entry!r}")
            layer, op, every = entry
            linear = isinstance(op, str) and linear_parts(op) is not None
            if not isinstance(layer, int) or layer < (-1 if linear else 0):
                raise ConfigError(f"schedule layer must be a layer index, got {layer!r}")
            if linear and self.scope != "all_linear":
                raise ConfigError(f"{op!r} is a linear layer's check: use scope='all_linear'")
            if op not in ALL_OPS and not linear:
                raise ConfigError(
                    f"unknown op {op!r} in schedule; choose from {list(ALL_OPS)} or, with "
                    f"scope='all_linear', a linear layer's 'role:op' (op one of "
                    f"{list(LINEAR_OPS)})"
                )
            if not isinstance(every, int) or every < 1:
                raise ConfigError(f"schedule 'every' must be an integer >= 1, got {every!r}")
            entries.append((layer, op, every))
        if len({(layer, op) for layer, op, _ in entries}) != len(entries):
            raise ConfigError("a (layer, op) appears twice in the schedule")
        if len({every for *_, every in entries if every > 1}) > 1:
            raise ConfigError(
                "one period per schedule (every step, every k steps, or never): a compiled "
                "model then holds two graphs"
            )
        return tuple(sorted(entries, key=lambda e: (e[0], op_key(e[1]))))

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ABFTConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - fields):
            raise ConfigError(f"unknown ABFTConfig fields {unknown}; choose from {sorted(fields)}")
        tuples = {k: tuple(tuple(e) if isinstance(e, list) else e for e in v)
                  for k, v in data.items() if isinstance(v, list)}  # fmt: skip
        return cls(**(data | tuples))

    def replace(self, **changes: object) -> ABFTConfig:
        return dataclasses.replace(self, **changes)
