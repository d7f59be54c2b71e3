"""The GEMM checks by the registered Triton ops (where the module's
:class:`~attnchecker.attention.impl.Impl` says ``kernels``: ``check_impl="triton"`` on CUDA, or in
Triton's interpreter): what :mod:`~attnchecker.attention.projection` runs instead of
:func:`~attnchecker.attention.checks.projection_check_` where :func:`runs_kernels` says so, and
:func:`gemm_check`, one GEMM's check as an :class:`~attnchecker.attention.impl.Impl` runs it.

Per projection and step: one ``proj_weights`` (cached on the step clock: :func:`weight_sums`,
shared with the backward's dX check), then per call one ``proj_verify`` and one ``proj_repair``
that returns at once on a clean call (:mod:`attnchecker.kernels.projection_check`). The records
go straight into the module's log rows (:meth:`~attnchecker.attention.records.Records.direct_log`,
which also says what a checkpointing replay records); nothing is noted, nothing committed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnchecker.abft.gemm import as_multiplied, gemm_check_, limits
from attnchecker.attention import regions
from attnchecker.attention.checks import Projection
from attnchecker.attention.impl import Impl
from attnchecker.attention.state import AttentionState, Clock

__all__ = ["check_group", "gemm_check", "runs_kernels", "sites_of", "weight_refs", "weight_sums"]


def runs_kernels(impl: Impl) -> bool:
    """Whether the GEMM checks run the registered ops: ``impl`` says so. A model being compiled
    calls them too, one extern call each (issue 54; before, its graph traced the checks' torch
    reference inline: weight sums every call, repairs that always ran)."""
    return impl.kernels


def gemm_check(
    impl: Impl, out: Tensor, x: Tensor, y: Tensor, *, max_rows: int, scale: float,
    x_rows: Tensor | None = None, y_cols: Tensor | None = None, refs: Tensor | None = None,
    rec: Tensor | None = None, step: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:  # fmt: skip
    """:func:`~attnchecker.abft.gemm.gemm_check_` of out = x @ y as ``impl`` runs it: its
    region (eager or compiled), or the registered ops of ``attnchecker.kernels.gemm_check``
    (rows only, every flagged row repaired, no ``max_rows`` budget; columns located on a flag),
    which with ``rec`` (a zeroed (7,) float64 record row) and ``step`` (the clock) write the
    record there and return None, else the same five results. ``refs``: y's references for the
    kernels (``gemm_refs`` of y as the GEMM multiplied it), when the caller has them (a
    weight's, once per step)."""
    if not runs_kernels(impl):
        return regions.run(gemm_check_, impl.region(out.dtype), out, x, y, max_rows=max_rows,
                           scale=scale, x_rows=x_rows, y_cols=y_cols)  # fmt: skip
    from attnchecker.kernels.gemm_check import check_

    own = rec is None
    if own:
        rec = torch.zeros(7, dtype=torch.float64, device=out.device)
        step = torch.zeros(1, dtype=torch.float64, device=out.device)
    x, y = as_multiplied(out, x, y)
    floor, a, c, cap, *_ = limits(out, x, y, scale)
    with torch.no_grad():
        check_(out, x, y, rec, step, floor=floor, a=a, c=c, cap=cap, x_rows=x_rows, refs=refs)
    regions.ran("_gemm_region", "triton", None)
    if not own:
        return None
    return rec[0].float(), rec[1].float(), rec[2].float(), rec[3] > 0, rec[4] > 0


def weight_sums(clock: Clock, weight: Tensor, bias: Tensor | None, groups: int,
                conv1d: bool, dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    """``proj_weights`` of a projection, once per optimizer step (the clock's ``weights``
    :class:`StepMemo`: micro-batches share it), of W and b as the GEMM multiplies them: rounded
    to ``dtype`` first where it is narrower (autocast's copy; sums of the fp32 parameter would
    differ from the product's by u_bf16 of its magnitude, the term the rounding-tight bound
    removes). The eager and compiled regions compute their weight sums inside the region
    instead, per call (:func:`~attnchecker.attention.checks.weight_sums`: fused with the check
    by the compiler)."""
    from attnchecker.kernels.projection_check import proj_weights
    from attnchecker.kernels.triton_utils import round_code

    dtype = weight.dtype if dtype is None else dtype

    def make() -> Tensor:
        with torch.no_grad():  # rounded in the kernel (no copy of W: issue 55's first version
            w, b = (None if t is None else t.detach() for t in (weight, bias))  # cast it, 0.1
            return proj_weights(w, b, groups, conv1d, round_code(w.dtype, dtype))  # ms at 8B)

    return clock.weights.get(("proj", groups, conv1d, dtype), (weight, bias), make)


def weight_refs(clock: Clock, weight: Tensor, bias: Tensor | None, groups: int,
                conv1d: bool, dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    """W's references for the backward's dX check (``gemm_refs`` of W as (N, K), as the GEMM
    multiplies it in ``dtype``): part of the step's :func:`weight_sums`, so the forward check
    and the dX check share one pass."""
    from attnchecker.kernels.projection_check import refs_of

    sums = weight_sums(clock, weight, bias, groups, conv1d, dtype)
    N, K = (weight.shape[1], weight.shape[0]) if conv1d else weight.shape
    return refs_of(sums, N, K, groups)


def sites_of(p: Projection) -> tuple[int, ...]:
    """The site (an index into ``p.sites``) that counts each of its head groups, in their own
    order (:meth:`Projection.group_order`)."""
    order = p.group_order() or tuple(range(p.groups))
    site, j = [0] * p.groups, 0
    for s, n in enumerate(p.counted):
        for g in order[j : j + n]:
            site[g] = s
        j += n
    return tuple(site)


def check_group(
    state: AttentionState, x: Tensor, pairs: list[tuple[Projection, Tensor]],
    checked: tuple[str, ...], *, factor: float, floor: float, absf: float, cap: float,
    bounds: bool,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Check and repair in place the outputs y (B, L, N_i) of the projections of one input x
    (B, L, K), their records into ``state``'s log rows of the ``checked`` sites; with
    ``bounds``, returns the row references and the tolerances (T, sum G) as the eager
    region does (``mode="passing"``: for the core), else (None, None)."""
    from attnchecker.kernels.projection_check import check_, norms

    K = x.shape[-1]
    x2 = x.detach().reshape(-1, K)
    T = x2.shape[0]
    state.follow(x.device)  # moved without a root forward (a layer alone)
    log, row = state.records.direct_log(), state.records.direct_row
    refs, bound = [], []
    with torch.no_grad():
        for p, y in pairs:
            y2 = y.data.view(T, y.shape[-1])
            ws = weight_sums(state.clock, p.weight, p.bias, p.groups, p.conv1d, y2.dtype)
            rows = [row(s, on=checked.__contains__) for s in p.sites]
            scr = check_(y2, x2, p.weight.detach(), None if p.bias is None else p.bias.detach(),
                         p.conv1d, ws, sites_of(p), log, state.clock.count, rows, factor=factor,
                         floor=floor, absf=absf, cap=cap)  # fmt: skip
            refs.append(scr[: T * p.groups].view(T, p.groups))
            if bounds:  # the tolerance as the verify kernel computes it
                xn1 = scr[3 * T * p.groups : 3 * T * p.groups + T].view(T, 1)
                l1 = torch.linalg.vector_norm(y2.view(T, p.groups, -1), 1, dim=-1,
                                              dtype=torch.float32)  # fmt: skip
                mag = xn1 * norms(ws, y2.shape[1], K, p.groups, floor)
                bound.append(torch.add(torch.minimum(l1, cap * mag) * absf, mag, alpha=factor))
    if not bounds:  # nothing for the core
        return None, None
    cat = (lambda ts: ts[0]) if len(refs) == 1 else (lambda ts: torch.cat(ts, 1))
    return cat(refs), cat(bound)
