"""The projections' checks by the registered Triton ops (``check_impl="triton"`` on CUDA, or in
Triton's interpreter): what :mod:`~attnchecker.attention.projection` runs instead of
:func:`~attnchecker.attention.checks.projection_check_` where :func:`available` says so.

Per projection and step: one ``proj_weights`` (cached on the step clock: :func:`weight_sums`,
shared with the backward's dX check), then per call one ``proj_verify`` and one ``proj_repair``
that returns at once on a clean call (:mod:`attnchecker.kernels.projection_check`). The records
go straight into the module's log rows; nothing is noted, nothing committed. A checkpointing
replay's forward is checked and repaired the same way but records nothing: what the first pass
found was counted then, and a fault that hits the recomputation alone is corrected there
uncounted (the eager region instead compares a replay's records with the first pass's,
:meth:`~attnchecker.attention.records.Records.commit`; the kernels' records are summed in the
log as they are made, with no first pass's to compare with).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from attnchecker.attention.checks import Projection
from attnchecker.attention.sites import in_replay
from attnchecker.attention.state import AttentionState, Clock
from attnchecker.kernels import gemm_check_kernels

__all__ = ["available", "check_group", "sites_of", "weight_refs", "weight_sums"]


def available(state: AttentionState, on: Tensor) -> bool:
    """Whether the forward checks of ``state`` run the registered ops for output ``on``: its
    ``check_impl`` resolves to ``"triton"`` there, the kernels can run and the call is eager."""
    return gemm_check_kernels(state.config.check_impl, on) is not None


def weight_sums(clock: Clock, weight: Tensor, bias: Tensor | None, groups: int,
                conv1d: bool) -> Tensor:  # fmt: skip
    """``proj_weights`` of a projection, once per step: cached on ``clock`` (emptied at every
    tick), keyed by the weight and bias objects (held, so an id is not reused within the step),
    their storage and version (an in-place edit between calls is seen; a fused optimizer's is
    not, which the tick covers)."""
    from attnchecker.kernels.projection_check import proj_weights

    ptr = 0 if isinstance(weight, FakeTensor) else weight.data_ptr()  # (a shapes-only trace)
    key = ("proj", id(weight), ptr, weight._version, groups, conv1d, id(bias))
    hit = clock.cache.get(key)
    if hit is None:
        with torch.no_grad():
            sums = proj_weights(weight.detach(), None if bias is None else bias.detach(), groups,
                                conv1d)  # fmt: skip
        hit = clock.cache[key] = (weight, bias, sums)
    return hit[2]


def weight_refs(clock: Clock, weight: Tensor, bias: Tensor | None, groups: int,
                conv1d: bool) -> Tensor:  # fmt: skip
    """W's references for the backward's dX check (``gemm_refs`` of W as (N, K)): part of the
    step's :func:`weight_sums`, so the forward check and the dX check share one pass."""
    from attnchecker.kernels.projection_check import refs_of

    sums = weight_sums(clock, weight, bias, groups, conv1d)
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
    checked: tuple[str, ...], *, factor: float, floor: float, bounds: bool,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Check and repair in place the outputs y (B, L, N_i) of the projections of one input x
    (B, L, K), their records into ``state``'s log rows of the ``checked`` sites; with
    ``bounds``, returns the row references and the magnitude bounds (T, sum G) as the eager
    region does (``mode="passing"``: for the core), else (None, None)."""
    from attnchecker.kernels.projection_check import check_, norms

    K = x.shape[-1]
    x2 = x.detach().reshape(-1, K)
    T = x2.shape[0]
    if state.records.log.device != x.device:  # moved without a root forward (a layer alone)
        state.records.to(x.device)
    log, rows_of = state.records.log, state.records.row
    if in_replay():  # checked and repaired, not recorded (see the module docstring)
        checked = ()
    refs, bound = [], []
    with torch.no_grad():
        for p, y in pairs:
            y2 = y.data.view(T, y.shape[-1])
            ws = weight_sums(state.clock, p.weight, p.bias, p.groups, p.conv1d)
            rows = [rows_of(s) if s in checked else -1 for s in p.sites]
            scr = check_(y2, x2, p.weight.detach(), None if p.bias is None else p.bias.detach(),
                         p.conv1d, ws, sites_of(p), log, state.clock.count, rows, factor=factor,
                         floor=floor)  # fmt: skip
            refs.append(scr[: T * p.groups].view(T, p.groups))
            if bounds:
                xn1 = scr[3 * T * p.groups : 3 * T * p.groups + T].view(T, 1)
                bound.append(xn1 * norms(ws, y2.shape[1], K, p.groups, floor))
    if not bounds:  # nothing for the core
        return None, None
    cat = (lambda ts: ts[0]) if len(refs) == 1 else (lambda ts: torch.cat(ts, 1))
    return cat(refs), cat(bound)
