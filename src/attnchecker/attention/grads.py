"""Checked backward GEMMs: every gradient product of protected attention (and, with
``scope="all_linear"``, of every linear layer) verified with checksums and repaired in the same
backward pass.

Two autograd functions compute exactly what autograd computes for the op they replace (the same
ATen calls in the same layouts, so a clean protected step's gradients are those of the plain
model, bitwise on CPU), then check each gradient and recompute what fails:

- :func:`checked_matmul`, the attention core's c = a @ b on (B, H, M, K) x (B, H, K, N): the
  scores q k^T and the context p v. Gradients da = dc b^T and db = a^T dc (dQ = dS K,
  dK = dS^T Q, dP = dO V^T, dV = P^T dO). Every row of each gradient (of dK and dV: every key
  row) is checked against the thin product that predicts its sum; the ``max_heads`` (batch, head)
  matrices with most flagged rows are recomputed whole (any pattern inside them).
- :func:`checked_linear`, y = x W^T + b (Conv1D: x W + b) on T tokens: dX = dY W and dW = dY^T X
  are checked by rows and by columns; up to ``max_rows`` worst rows and the worst column are
  recomputed from dY and the saved operand, then every row is checked again (what still fails is
  ``lost``). The bias gradient is a reduction, not a GEMM, and is not checked.

The check of a product out = x @ y (rows i, inner k, n columns) compares the recomputed row sum
with x_i . (y 1), and flags it when they differ by more than the rounding bound: the core's
rows by :func:`product_residual`'s rounding-tight bound (the delivered row's rounding on its L1
norm, the accumulation's on the magnitude sum_k |x_ik| sum_n |y_kn|, exact when x >= 0 as the
probabilities are, else a Cauchy-Schwarz bound), the linear layers' by
:func:`~attnchecker.abft.gemm.gemm_check_`'s.

The records leave the backward as the *gradient of* a small leaf tensor that requires grad (one
per protected module, (n ops, 7) float64 records of
:data:`~attnchecker.attention.state.RECORD_FIELDS`): autograd accumulates them over layers and
steps, nothing is synchronised, and compiled backward graphs carry them like any gradient. The
one exception: a linear layer's checks by the registered Triton ops add their records into that
gradient in place (:func:`~attnchecker.attention.records.grad_of`; the ops write the rows
themselves, on a flag), from eager code only. Fault injection reaches every gradient through its
named site (:data:`GRAD_OPS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from attnchecker.abft.cast import autocast_operands
from attnchecker.abft.gemm import col_norms, gemm_check_, row_norms
from attnchecker.abft.tolerance import (
    norm_bound,
    tight_excess,
)
from attnchecker.attention import regions
from attnchecker.attention.checks import detected, index_constant, log_rows, record
from attnchecker.attention.impl import EAGER, Impl
from attnchecker.attention.ops import CORE_GRAD_OPS, GRAD_OPS
from attnchecker.attention.records import grad_of, new_records_sink

__all__ = [
    "CORE_GRAD_OPS",
    "GradSite",
    "LinearPlan",
    "MatmulPlan",
    "checked_linear",
    "checked_matmul",
    "new_records_sink",
    "product_check_",
    "product_residual",
]

_F32 = torch.float32

# Run a site's injection hooks on a gradient: (op, tensor) -> None, edits in place
GradSite = Callable[[str, Tensor], None]


def _norm(t: Tensor) -> Tensor:
    """||t||_F of each matrix of t (..., M, K): (...) fp32, an upper bound that does not
    collapse where the squares underflow (:func:`~attnchecker.abft.tolerance.norm_bound`)."""
    return norm_bound(t, (-2, -1))


def product_residual(
    out: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    scale: float,
    nonneg: bool = False,
    norms: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(residual, excess) (..., M) of the rows of out = x @ y, x (..., M, K), y (..., K, N):
    excess > 0 (or NaN) where a row is flagged. ``nonneg``: x >= 0 (probabilities), so one thin
    GEMM gives the reference and an exact magnitude; ``norms``: (||x||_F, ||y||_F) already at
    hand.

    The tolerance is the rounding-tight bound of
    :func:`~attnchecker.abft.tolerance.tight_excess` (issue 55): the delivered row's own rounding
    charged to its L1 norm, the accumulation's to the magnitude. It needs a reference free of
    the operands' rounding: y's row sums accumulated in fp64 and rounded once to fp32, and the
    GEMV x . (y 1) in fp32 (an fp32 copy of a half-precision x: its reference in x's dtype would
    cost 2 u of the magnitude, the term the tight bound removes). The magnitude is
    sum_k |x_ik| sum_n |y_kn| <= ||x_i|| sqrt(N) ||y||_F (Cauchy-Schwarz twice, no |x| pass),
    with the row norms ||x_i|| where x's rows are contiguous (one fast pass) and ||x||_F in their
    place where they are not (a strided pass would cost more than the GEMV); exact when x >= 0."""
    rows_contiguous = x.stride(-1) == 1  # read outside autocast(enabled=False): see gemm_check_
    K, N = y.shape[-2], y.shape[-1]
    with torch.autocast(out.device.type, enabled=False):
        xf = x.to(_F32)
        ysum = y.sum(-1, dtype=torch.float64).to(_F32)  # (..., K)
        if nonneg:
            yabs = y.abs().sum(-1, dtype=_F32)  # y is the small operand here (dO)
            both = xf @ torch.stack([ysum, yabs], -1)  # (..., M, 2)
            ref, mag = both[..., 0], both[..., 1]
        else:
            ref = (xf @ ysum.unsqueeze(-1)).squeeze(-1)  # (..., M)
            yn = _norm(y) if norms is None else norms[1]  # (...)
            if rows_contiguous:  # (..., M)
                xn = norm_bound(x, -1)
            else:  # (..., 1)
                xn = (_norm(x) if norms is None else norms[0]).unsqueeze(-1)
            mag = xn * (yn * math.sqrt(N)).unsqueeze(-1)
        res = out.sum(-1, dtype=_F32) - ref
        rounded = sum(t.dtype != out.dtype for t in (x, y))
        return res, tight_excess(res, out, mag, inner=K, length=N, scale=scale, rounded=rounded)


def product_check_(out: Tensor, x: Tensor, y: Tensor, **kw) -> Tensor:
    """:func:`~attnchecker.abft.gemm.gemm_check_` of out = x @ y (same arguments) as the (1, 5)
    float32 record of :func:`~attnchecker.attention.checks.record`."""
    return record(*gemm_check_(out, x, y, **kw))


def heads_grad_check_(
    grad: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    scale: float,
    max_heads: int,
    nonneg: bool = False,
    norms: tuple[Tensor, Tensor] | None = None,
    back: bool = False,
) -> Tensor:
    """Check the rows of out = x @ y (B, H, M, K) x (B, H, K, N) per (batch, head), where out is
    ``grad`` (``back``: grad is out^T, its own layout), and repair in place the ``max_heads``
    matrices with the most flagged rows by recomputing them from x and y (as
    :func:`~attnchecker.attention.heads.heads_repair_`); returns its (1, 5) record."""
    from attnchecker.attention.heads import heads_repair_

    out = grad.mT if back else grad
    rows = product_residual(out, x, y, scale=scale, nonneg=nonneg, norms=norms)

    def recompute(b: Tensor, h: Tensor) -> list[Tensor]:  # grad's matrices (b, h), its layout
        return [y[b, h].mT @ x[b, h].mT if back else x[b, h] @ y[b, h]]

    return heads_repair_([grad], [rows], recompute, max_heads=max_heads)


def _sink_grad(
    shape: torch.Size, index: tuple[int, ...], recs: list[Tensor], step: Tensor
) -> Tensor:
    """The records (n, 5) of the checks just run as a gradient of ``sink`` (rows ``index``;
    of a sink of ``shape``, on the device of the clock ``step``)."""
    rec = torch.cat(recs)
    rows = log_rows(rec, detected(rec), step)  # (n, 7)
    grad = torch.zeros(shape, dtype=torch.float64, device=step.device)
    return grad.index_copy_(0, index_constant(index, step.device), rows)


def _linear_grad_kernels(
    dx: Tensor | None, dw: Tensor | None, dy: Tensor, w: Tensor, a: Tensor, b: Tensor,
    index: tuple[int, ...], sink: Tensor, clock: Tensor, refs: Tensor,
    plan: LinearPlan,
) -> Tensor | None:  # fmt: skip
    """A linear layer's dX and dW checks (those given) by the registered Triton ops at the
    clock's step: three ops a check, two for dX (W's references at hand). Their records are
    added into ``sink.grad`` in place (made once, zeroed in place by a drain), or, in a graph
    being compiled (which may not mutate a tensor from outside the backward), into a fresh
    records tensor returned as ``sink``'s gradient."""
    from attnchecker.attention.kernel_checks import gemm_check

    compiling = torch.compiler.is_compiling()
    recs = sink.new_zeros(sink.shape) if compiling else grad_of(sink)  # (n ops, 7)
    kw = {"max_rows": plan.max_rows, "scale": plan.scale, "step": clock}
    rows = iter(index)
    if dx is not None:
        gemm_check(plan.impl, dx, dy, w, rec=recs[next(rows)], refs=refs, **kw)
    if dw is not None:
        gemm_check(plan.impl, dw, a, b, rec=recs[next(rows)], **kw)
    return recs if compiling else None


def _linear_grad_region(
    dx: Tensor | None,
    dw: Tensor | None,
    dy: Tensor,
    w: Tensor,
    a: Tensor,
    b: Tensor,
    step: Tensor,
    conv1d: bool,
    index: tuple[int, ...],
    shape: torch.Size,
    max_rows: int,
    scale: float,
) -> Tensor:
    """One check region for a linear layer's backward: the checks of dX (T, K) = dY (T, N) W
    (N, K) and of dW = a @ b (dY^T X; Conv1D's X^T dY), those given, sharing dY's row and
    column norms, and their records as the sink's gradient (``shape``, rows ``index``)."""
    kw = {"max_rows": max_rows, "scale": scale}
    recs = []
    if dx is not None:
        recs.append(product_check_(dx, dy, w, x_rows=row_norms(dy), **kw))
    if dw is not None:
        cols = col_norms(dy)  # (N,): dY^T's rows (dW = dY^T X) or dY's columns (X^T dY)
        shared = {"y_cols": cols} if conv1d else {"x_rows": cols}
        recs.append(product_check_(dw, a, b, **shared, **kw))
    return _sink_grad(shape, index, recs, step)


def _matmul_grad_region(
    da: Tensor | None,
    db: Tensor | None,
    dc: Tensor,
    a: Tensor,
    b: Tensor,
    step: Tensor,
    nonneg_a: bool,
    b_transposed: bool,
    index: tuple[int, ...],
    shape: torch.Size,
    max_heads: int,
    scale: float,
) -> Tensor:
    """One check region for the core's c = a @ b backward: the checks of da = dc b^T and
    db = a^T dc (B, H, ., .), those given, and their records as the sink's gradient."""
    kw = {"scale": scale, "max_heads": max_heads}
    # ||dc|| per head, shared by both checks when dc is the large operand (dS)
    dcn = _norm(dc) if b_transposed and da is not None and db is not None else None
    recs = []
    if da is not None:  # dQ = dS K, dP = dO V^T
        norms = None if dcn is None else (dcn, _norm(b))
        recs.append(heads_grad_check_(da, dc, b.mT, norms=norms, **kw))
    if db is not None and b_transposed:  # b = key^T: check the rows of dK = dc^T a
        norms = None if dcn is None else (dcn, _norm(a))
        recs.append(heads_grad_check_(db, dc.mT, a, norms=norms, back=True, **kw))
    elif db is not None:  # dV = p^T dO, p >= 0
        recs.append(heads_grad_check_(db, a.mT, dc, nonneg=nonneg_a, **kw))
    return _sink_grad(shape, index, recs, step)


def _site(hook: GradSite | None, op: str, t: Tensor) -> None:
    if hook is not None and not torch.compiler.is_compiling():
        with torch.no_grad():
            hook(op, t)


def _folded(t: Tensor) -> Tensor:
    """t (B, H, M, K) as torch.matmul folds it for bmm, (B * H, M, K) (a copy where the batch
    dimensions do not merge, as HF's transposed heads): the backward multiplies exactly the
    layouts autograd's bmm backward does, so a clean protected step's gradients are the plain
    model's bitwise (measured on an AVX-512 CPU: ``dS @ K`` on the unfolded views rounds
    differently from autograd's ``bmm`` of the folded copies, by ~1e-6 relative)."""
    return t.reshape(-1, *t.shape[-2:])


@dataclass(frozen=True)
class MatmulPlan:
    """What :func:`checked_matmul`'s backward does: ``ops``, the rows in the sink (of
    :data:`GRAD_OPS`) of a's and b's gradients; ``check``, which of them are checked;
    ``nonneg_a``: a >= 0 (probabilities); ``b_transposed``: b is key^T (the scores), so b's
    gradient is checked by key rows; the repair budget, the tolerance scale, the sites' hook and
    how the checks run."""

    ops: tuple[int, int]
    check: tuple[bool, bool]
    max_heads: int
    scale: float
    nonneg_a: bool = False
    b_transposed: bool = False
    hook: GradSite | None = None
    impl: Impl = EAGER


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, sink, step, plan: MatmulPlan):
        ctx.save_for_backward(a, b, step.clone() if any(plan.check) else None)
        ctx.sink_shape, ctx.plan = sink.shape, plan
        return torch.matmul(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b, step = ctx.saved_tensors
        plan: MatmulPlan = ctx.plan
        op_a, op_b = plan.ops
        da = db = None
        dc3 = _folded(dc)
        if ctx.needs_input_grad[0]:
            da = dc3.bmm(_folded(b).transpose(1, 2)).view(a.shape)  # (B, H, M, K)
            _site(plan.hook, GRAD_OPS[op_a], da)
        if ctx.needs_input_grad[1]:
            db = _folded(a).transpose(1, 2).bmm(dc3).view(b.shape)  # (B, H, K, N)
            _site(plan.hook, GRAD_OPS[op_b], db)
        check_a, check_b = plan.check[0] and da is not None, plan.check[1] and db is not None
        grad_sink = None
        if check_a or check_b:
            index = tuple(op for op, on in ((op_a, check_a), (op_b, check_b)) if on)
            args = (da if check_a else None, db if check_b else None, dc, a, b, step)
            args += (plan.nonneg_a, plan.b_transposed, index, ctx.sink_shape, plan.max_heads,
                     plan.scale)  # fmt: skip
            grad_sink = regions.run(_matmul_grad_region, plan.impl.region(dc.dtype), *args)
        return da, db, grad_sink, None, None


def checked_matmul(
    a: Tensor,
    b: Tensor,
    sink: Tensor,
    step: Tensor,
    *,
    ops: tuple[str, str],
    check: tuple[bool, bool],
    max_heads: int,
    scale: float,
    nonneg_a: bool = False,
    b_transposed: bool = False,
    hook: GradSite | None = None,
    impl: Impl = EAGER,
) -> Tensor:
    """``torch.matmul(a, b)`` of (B, H, M, K) x (B, H, K, N) whose backward checks and repairs
    the gradients (named by ``ops``: a's, b's) that ``check`` selects, records into
    ``sink.grad`` at the clock ``step``; ``hook`` runs at both sites, checked or not; ``impl``:
    how the checks run (the module's :class:`~attnchecker.attention.impl.Impl`)."""
    if not any(check) and hook is None:
        return torch.matmul(a, b)
    idx = (GRAD_OPS.index(ops[0]), GRAD_OPS.index(ops[1]))
    a, b = autocast_operands(a, b)
    plan = MatmulPlan(idx, check, max_heads, scale, nonneg_a, b_transposed, hook, impl)
    return _Matmul.apply(a, b, sink, step, plan)


@dataclass(frozen=True)
class LinearPlan:
    """What :func:`checked_linear`'s backward does: ``ops``, (row of the sink, site name) of dX
    and of dW; ``check``, which of them are checked; ``conv1d``: transformers' Conv1D (y = x W +
    b); the repair budget, the tolerance scale, the sites' hook and how the checks run."""

    ops: tuple[tuple[int, str], tuple[int, str]]
    check: tuple[bool, bool]
    conv1d: bool
    max_rows: int
    scale: float
    hook: GradSite | None = None
    impl: Impl = EAGER


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sink, step, plan: LinearPlan, refs, segments):
        # the Triton kernels (refs: W's sums for them, or None) read the clock itself in the
        # backward and add into sink.grad; the eager ops return records at the forward's step
        kernels = refs is not None or segments is not None
        ctx.save_for_backward(x, weight, step.clone() if any(plan.check) and not kernels else None)
        ctx.sink_shape, ctx.plan, ctx.has_bias = sink.shape, plan, bias is not None
        ctx.kernel_args = (sink, step, refs) if kernels else None
        if segments is not None:  # the accumulator GEMM, a call a column range (site)
            return _accumulator_forward(x, weight, bias, step, plan, segments)
        if plan.conv1d:  # transformers' Conv1D
            out = x.view(-1, x.shape[-1])
            out = out @ weight if bias is None else torch.addmm(bias, out, weight)
            return out.view(*x.shape[:-1], weight.shape[-1])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, step = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        (op_x, op_w), conv1d = plan.ops, plan.conv1d
        dy2 = dy.reshape(-1, dy.shape[-1])  # (T, N)
        x2 = x.reshape(-1, x.shape[-1])  # (T, K)
        dx = dx2 = dw = db = None
        w = weight.t() if conv1d else weight  # (N, K)
        # dW (N, K) = dY^T X; Conv1D's (K, N) = X^T dY
        a, b = (x2.t(), dy2) if conv1d else (dy2.t(), x2)
        if plan.impl.accumulator and ctx.kernel_args is not None and any(plan.check):
            return _accumulator_backward(ctx, dy2, x2, w, a, b, x.shape)
        if ctx.needs_input_grad[0]:
            dx2 = dy2.mm(w)  # (T, K)
            _site(plan.hook, op_x[1], dx2)
            dx = dx2.view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = a.mm(b)
            _site(plan.hook, op_w[1], dw)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        check_x, check_w = plan.check[0] and dx2 is not None, plan.check[1] and dw is not None
        grad_sink = None
        if check_x or check_w:
            index = tuple(op[0] for op, on in ((op_x, check_x), (op_w, check_w)) if on)
            checked = (dx2 if check_x else None, dw if check_w else None)
            if ctx.kernel_args is not None:  # the registered ops, records added into sink.grad
                sink, clock, refs = ctx.kernel_args
                grad_sink = _linear_grad_kernels(*checked, dy2, w, a, b, index, sink, clock, refs,
                                                 plan)  # fmt: skip
                regions.ran(_linear_grad_region.__qualname__, "triton", None)
            else:
                args = (*checked, dy2, w, a, b, step, conv1d, index, ctx.sink_shape,
                        plan.max_rows, plan.scale)  # fmt: skip
                how = plan.impl.region(dy2.dtype)
                grad_sink = regions.run(_linear_grad_region, how, *args)
        return dx, dw, db, grad_sink, None, None, None, None


Segment = tuple[int, int, Tensor, Tensor, "Tensor | None"]
"""A column range [start, stop) of a linear layer's output computed by the accumulator GEMM
(one site: a fused projection has three), its record row (7,), the references of its columns
of W as multiplied (``gemm_refs``), and an emulated accumulator error (or None)."""


def _accumulator_forward(x: Tensor, weight: Tensor, bias: Tensor | None, step: Tensor,
                         plan: LinearPlan, segments: tuple[Segment, ...]) -> Tensor:  # fmt: skip
    """y = x W^T + b by the accumulator GEMM (:mod:`attnchecker.kernels.acc_gemm`), one call
    per segment and its record, their outputs side by side."""
    from attnchecker.kernels.acc_gemm import checked_mm

    y = weight if plan.conv1d else weight.t()  # (K, N)
    x2 = x.reshape(-1, x.shape[-1])
    parts = []
    for start, stop, rec, wrefs, delta in segments:
        cut = slice(start, stop)
        parts.append(checked_mm(x2, y[:, cut], None if bias is None else bias[cut], rec, step,
                                refs=wrefs, delta=delta, scale=plan.scale))  # fmt: skip
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 1)  # (a fused projection: a copy)
    return out.view(*x.shape[:-1], y.shape[1])


def _accumulator_backward(ctx, dy2: Tensor, x2: Tensor, w: Tensor, a: Tensor, b: Tensor,
                          shape: torch.Size) -> tuple:  # fmt: skip
    """:class:`_Linear`'s backward where the accumulator GEMM computes the checked gradients
    (``check_impl="accumulator"``): dX = dY W against W's references, dW = a @ b, each checked
    on its accumulator as it is computed, records added into ``sink.grad`` (or, in a graph
    being compiled, a fresh records tensor returned as its gradient)."""
    from attnchecker.kernels.acc_gemm import checked_mm

    plan: LinearPlan = ctx.plan
    (op_x, op_w) = plan.ops
    sink, clock, refs = ctx.kernel_args
    compiling = torch.compiler.is_compiling()
    recs = sink.new_zeros(sink.shape) if compiling else grad_of(sink)  # (n ops, 7)

    def product(op: tuple[int, str], check: bool, p: Tensor, q: Tensor, r: Tensor | None):
        if not check:
            out = p.mm(q)
            _site(plan.hook, op[1], out)
            return out
        delta = _site_delta(plan.hook, op[1], lambda: p.mm(q))
        return checked_mm(p, q, None, recs[op[0]], clock, refs=r, delta=delta, scale=plan.scale)

    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = product(op_x, plan.check[0], dy2, w, refs).view(shape)
    if ctx.needs_input_grad[1]:
        dw = product(op_w, plan.check[1], a, b, None)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dy2.sum(0)
    regions.ran(_linear_grad_region.__qualname__, "accumulator", None)
    return dx, dw, db, recs if compiling else None, None, None, None, None


def _site_delta(hook: GradSite | None, op: str, product: Callable[[], Tensor]) -> Tensor | None:
    """A fault site's injection as an error of the accumulator GEMM's accumulator (fp32, the
    product's shape), or None where no hook edits it: the hook runs on a copy of the plain
    ``product()``, whose difference from the copy (INF and NaN as they came) the kernel adds
    before its epilogue, as a faulty tensor core would. Only while an injector is attached
    (tests, campaigns): the clean path runs no second GEMM."""
    if hook is None or torch.compiler.is_compiling():
        return None
    with torch.no_grad():
        probe = product()
        hit = probe.clone()
        hook(op, hit)
        if torch.equal(hit, probe):
            return None
        return torch.where(hit == probe, 0.0, hit.float() - probe.float())


def checked_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    sink: Tensor,
    step: Tensor,
    *,
    ops: tuple[tuple[int, str], tuple[int, str]],
    check: tuple[bool, bool],
    conv1d: bool,
    max_rows: int,
    scale: float,
    hook: GradSite | None = None,
    impl: Impl = EAGER,
    refs: Tensor | None = None,
    segments: tuple[Segment, ...] | None = None,
) -> Tensor:
    """The module's y = x W^T + b (``conv1d``: x W + b) whose backward checks and repairs dX and
    dW as ``check`` selects; ``ops`` = ((row of ``sink``, site name) of dX, of dW). Under autocast
    the operands are cast as autocast casts them for the module's own op. ``impl``: how the
    checks run (the module's :class:`~attnchecker.attention.impl.Impl`); ``refs``: the Triton
    kernels run them (``kernels.gemm_check``), these being W's references (``gemm_refs`` of W
    as (N, K) as the GEMM multiplies it, from the step's weight sums). ``segments``: y itself
    by the accumulator GEMM (:mod:`attnchecker.kernels.acc_gemm`), a call per :data:`Segment`
    (the columns of each site), checked as it is computed."""
    x, weight, bias = autocast_operands(x, weight, bias)
    plan = LinearPlan(ops, check, conv1d, max_rows, scale, hook, impl)
    return _Linear.apply(x, weight, bias, sink, step, plan, refs, segments)
