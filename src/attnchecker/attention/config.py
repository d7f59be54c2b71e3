"""``ABFTConfig``: what protected attention checks and what it does about errors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnchecker.errors import ConfigError

__all__ = [
    "ALL_OPS", "BACKENDS", "GRAD_OPS", "LINEAR_OPS", "OPS", "POLICIES", "SCOPES", "ABFTConfig",
]  # fmt: skip

OPS = ("q", "k", "v", "scores", "probs", "context", "out")
"""The checked operations, named by the site whose output they verify: the Q, K and V projections,
the scores Q K^T, the softmax probabilities, the context P V and the output projection."""

GRAD_OPS = (
    "dq", "dk", "dp", "dv",
    "dx.q", "dw.q", "dx.k", "dw.k", "dx.v", "dw.v", "dx.out", "dw.out",
)  # fmt: skip
"""The checked backward GEMMs of one attention module, named by the gradient they produce:
dQ = dS K, dK = dS^T Q, dP = dO V^T, dV = P^T dO, and each projection's dX = dY W and
dW = dY^T X under its site (a fused Q|K|V projection, one GEMM each, under its first site:
``dx.q``, ``dw.q``). See :mod:`~attnchecker.attention.grads`."""

ALL_OPS = OPS + GRAD_OPS

LINEAR_OPS = ("y", "dx", "dw")
"""The checked GEMMs of one linear layer outside attention (``scope="all_linear"``): its output
in the forward, dX and dW in the backward."""

SCOPES = ("attention", "all_linear")
POLICIES = ("raise", "skip_step", "warn")
MODES = ("naive", "passing")
BACKENDS = ("eager", "triton", "auto")


@dataclass(frozen=True, kw_only=True)
class ABFTConfig:
    """How :func:`attnchecker.protect_` protects a model. Defaults check everything, every step.

    - ``ops``: which operations are verified (a subset of :data:`ALL_OPS`: the forward's
      :data:`OPS` and the backward's :data:`GRAD_OPS`); the others still expose their named
      sites, so an empty tuple gives an instrumented but unprotected model.
    - ``scope``: ``"attention"`` checks the attention modules (their projections and core);
      ``"all_linear"`` also every other ``nn.Linear`` / ``Conv1D`` of the model (MLP, LM head,
      classifier), forward and backward (:data:`LINEAR_OPS`).
    - ``layers``: indices of the attention layers to protect (None: all).
    - ``mode``: ``"naive"`` computes every check's reference and bound from its own operands;
      ``"passing"`` takes the context check's reference from the V projection check (V's row
      sums from X and W, with that check's error bound: see
      :mod:`~attnchecker.attention.handoff`). Passing saves one reduction over V but its bound
      is loose: measured 1000x less sensitive in fp32 (``benchmarks/check_sensitivity.py``),
      which is why ``"naive"`` is the default.
    - ``policy``: what :meth:`ProtectionHandle.drain` does about an uncorrectable error.
    - ``max_rows``: token rows of a projection output that may be recomputed per call (covers
      whole-row errors and 2D blocks spanning up to this many tokens).
    - ``max_heads``: (batch, head) matrices of scores / probabilities / context that may be
      recomputed per call (any pattern inside them).
    - ``tolerance_scale``: multiplies every derived tolerance (>= 1 makes checks less sensitive).
    - ``backend``: ``"eager"`` runs the checked eager attention (materialised scores);
      ``"triton"`` the fused flash kernels with their checks inside
      (:mod:`attnchecker.kernels`: forward and backward, no L x L tensor), falling back to the
      eager engine, with a warning once, for a call they do not cover (attention dropout in
      training, soft-capping); ``"auto"`` is triton on CUDA where the family dispatches through
      transformers' attention interface, eager otherwise. The projections are checked by the
      same hooks in every backend.
    """

    ops: tuple[str, ...] = ALL_OPS
    scope: str = "attention"
    layers: tuple[int, ...] | None = None
    mode: str = "naive"
    policy: str = "raise"
    max_rows: int = 4
    max_heads: int = 2
    tolerance_scale: float = 1.0
    backend: str = "eager"

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
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        for name in ("max_rows", "max_heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
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

    def replace(self, **changes: object) -> ABFTConfig:
        return dataclasses.replace(self, **changes)
