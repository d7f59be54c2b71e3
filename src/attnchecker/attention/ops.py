"""The op table: every checked GEMM of protected attention (and of a linear layer), once.

An op is named by the tensor whose values its check verifies; that name is also the named site
where a fault can be placed (between the GEMM and its check), the config's switch
(``ABFTConfig.ops``), the record row it writes (:mod:`~attnchecker.attention.records`), the
events' ``op`` and the adaptive controller's unit of placement. Every tuple below is derived
from :data:`OP_TABLE`: a new check on a new GEMM is one entry here plus the call of its check
primitive where the GEMM runs (``engine``). The other engines name their own checks and map
them onto these ops: the SDPA route's, :data:`ROUTE_CHECKS`; the fused kernels',
``attnchecker.kernels.KERNEL_CHECKS`` (defined with the kernels, below this package).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALL_OPS", "CORE_GRAD_OPS", "GRAD_OPS", "INVARIANT_OPS", "LINEAR_OPS", "OPS", "OP_TABLE",
    "ROUTE_CHECKS", "Op",
    "in_backward", "linear_op", "linear_parts", "op", "op_key",
]  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One checked GEMM: ``name`` (its site), ``gemm`` (what it computes), ``backward`` (in
    the backward pass), ``part`` (``"projection"``, ``"core"``: of an attention module;
    ``"linear"``: of a linear layer outside attention, ``scope="all_linear"``) and ``engine``
    (the function that runs its check); ``stage``: its place in the execution order of one
    layer's pass (forward: projections, scores, probabilities, context, output projection, a
    linear layer after them; backward from the last: a linear layer's, the output
    projection's, dP / dV, dQ / dK, the Q / K / V projections'); ops of one stage do not feed
    one another (what a diagnosis reads to tell upstream from downstream)."""

    name: str
    gemm: str
    backward: bool
    part: str
    engine: str
    stage: int


_P, _C, _L = "projection", "core", "linear"
_HOOK = "attention.projection.projection_hook"
_CORE = "attention.core.attend"
_MATMUL = "attention.grads.checked_matmul"
_LIN = "attention.grads.checked_linear"

OP_TABLE: tuple[Op, ...] = (
    Op("q", "Q = X W_q^T + b_q", False, _P, _HOOK, 0),
    Op("k", "K = X W_k^T + b_k", False, _P, _HOOK, 0),
    Op("v", "V = X W_v^T + b_v", False, _P, _HOOK, 0),
    Op("scores", "S = Q K^T", False, _C, _CORE, 1),
    Op("probs", "P = softmax(S * scaling + mask)", False, _C, _CORE, 2),
    Op("context", "O = P V", False, _C, _CORE, 3),
    Op("out", "Y = O W_o^T + b_o", False, _P, _HOOK, 4),
    Op("dq", "dQ = dS K", True, _C, _MATMUL, 3),
    Op("dk", "dK = dS^T Q", True, _C, _MATMUL, 3),
    Op("dp", "dP = dO V^T", True, _C, _MATMUL, 2),
    Op("dv", "dV = P^T dO", True, _C, _MATMUL, 2),
    # a fused Q|K|V projection's gradients are one GEMM each, under its first site (dx.q, dw.q)
    Op("dx.q", "dX = dQ W_q", True, _P, _LIN, 4),
    Op("dw.q", "dW_q = dQ^T X", True, _P, _LIN, 4),
    Op("dx.k", "dX = dK W_k", True, _P, _LIN, 4),
    Op("dw.k", "dW_k = dK^T X", True, _P, _LIN, 4),
    Op("dx.v", "dX = dV W_v", True, _P, _LIN, 4),
    Op("dw.v", "dW_v = dV^T X", True, _P, _LIN, 4),
    Op("dx.out", "dO = dY W_o", True, _P, _LIN, 1),
    Op("dw.out", "dW_o = dY^T O", True, _P, _LIN, 1),
    Op("y", "Y = X W^T + b", False, _L, "attention.projection.linear_hook", 5),
    Op("dx", "dX = dY W", True, _L, _LIN, 0),
    Op("dw", "dW = dY^T X", True, _L, _LIN, 0),
)

_BY_NAME = {o.name: o for o in OP_TABLE}


def op(name: str) -> Op:
    """The table's entry for ``name`` (KeyError for an unknown op)."""
    return _BY_NAME[name]


def _names(*, backward: bool, parts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(o.name for o in OP_TABLE if o.backward == backward and o.part in parts)


OPS = _names(backward=False, parts=(_P, _C))
"""The forward checks of one attention module: the Q, K and V projections, the scores Q K^T,
the softmax probabilities, the context P V and the output projection; the rows of its log."""

GRAD_OPS = _names(backward=True, parts=(_C, _P))
"""The backward checks of one attention module, named by the gradient they produce (see
:mod:`~attnchecker.attention.grads`); the rows of its backward records."""

CORE_GRAD_OPS = _names(backward=True, parts=(_C,))
"""The core's backward checks (the eager engine's; the fused kernels check theirs)."""

CORE_OPS = _names(backward=False, parts=(_C,)) + CORE_GRAD_OPS
"""Every check of the attention core, forward and backward (its sites too): what only the
checked core runs. A module whose config asks none of them, and that has no hook at one of their
sites, runs the model's own attention (:meth:`~.state.AttentionState.needs_core`)."""

ALL_OPS = OPS + GRAD_OPS

ROUTE_CHECKS: dict[str, tuple[str, ...]] = {
    "lse": ("scores",),  # forward: the LSE bound
    "range": ("context", "probs"),  # forward: O within V's range (P is not materialised)
    "dq_bound": ("dq", "dp"),  # backward: dQ's bound (a fault in dP reaches dS, then dQ)
    "dk_sum": ("dk", "dp"),  # backward: sum_j dK_j = 0 (and dP's, through dS)
    "dv_sum": ("dv",),  # backward: sum_j dV_j = sum_i dO_i
}
"""The SDPA route's checks (:mod:`~attnchecker.attention.sdpa_core`) and the core ops that
switch each on (any of them); the first of them checked now names its record row."""

LINEAR_OPS = tuple(o.name for o in OP_TABLE if o.part == _L)
"""The checks of one linear layer outside attention (``scope="all_linear"``): its output in the
forward, dX and dW in the backward."""


INVARIANT_OPS = ("norm", "update.exp_avg", "update.exp_avg_sq", "update.momentum_buffer",
                 "update.param")
"""The checks beyond the GEMMs (``ABFTConfig.invariants``, issue 57), by the ``op`` of their
events: ``norm``, a normalisation module's output against its row recomputed from the input
(:mod:`attnchecker.models.norms`); ``update.<key>``, the optimizer's new state tensor or
parameter against row checksums of the update (:mod:`attnchecker.recovery.update_check`). They
are not GEMMs and not in :data:`OP_TABLE`: each is one switch for the whole model, not a
(layer, op) a schedule places; a campaign faults them at its sites of the same names."""


def op_key(name: str) -> tuple[int, str]:
    """Sort key of check names: the attention ops in table order, then linear layers' checks
    (:func:`linear_op`) by name."""
    return (ALL_OPS.index(name), "") if name in ALL_OPS else (len(ALL_OPS), name)


def linear_op(role: str, op: str) -> str:
    """The name of check ``op`` (of :data:`LINEAR_OPS`) of the linear layer ``role`` of a
    transformer block (its name inside the block, ``mlp.c_fc``; a layer outside the blocks: its
    whole name, ``lm_head``), as a schedule, a fault plan and the controller name it:
    ``mlp.c_fc:y``."""
    return f"{role}:{op}"


def linear_parts(name: str) -> tuple[str, str] | None:
    """``(role, op)`` of a :func:`linear_op` name; None for any other name."""
    role, sep, op = name.rpartition(":")
    return (role, op) if sep and role and op in LINEAR_OPS else None


def in_backward(name: str) -> bool:
    """Whether the check ``name`` (an attention op, or a linear layer's ``role:op``) runs in
    the backward pass."""
    parts = linear_parts(name)
    return op(parts[1] if parts else name).backward
