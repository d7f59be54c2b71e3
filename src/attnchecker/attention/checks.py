"""The checks protected attention runs: detect with checksums, repair by recomputing from operands.

Every check compares, per checked vector, a *reference* sum derived from the operands with the
sum *recomputed* from the delivered output, and flags the vector when they differ by more than
a rounding-error bound (NaN compares False, so NaN is flagged too). What is flagged is repaired
by recomputing a fixed number of units from the operands with the op that produced them: fixed
sizes, so no step needs a host synchronisation, and a repaired value is what a fault-free run
computes (up to the rounding of a smaller GEMM). Repairs write through ``.data``: the repaired
tensor may already be saved for backward (softmax saves its output), and the saved values must
become the repaired ones without tripping autograd's version check.

Projections, y = x W^T + b (T = B * L tokens, K inputs, N outputs in G head groups of n), one
call for all the projections of one input (Q, K and V share x), their weights stacked as one
projection (a copy of W_q | W_k | W_v per step, so the weight-side sums are one set of ops):

- rows: for every token t and group g, sum_{o in g} y_to against x_t . (sum_{o in g} W_o) +
  sum_{o in g} b_o, one thin GEMM (T, K) x (K, sum G) in fp32 for all of them, from x and W as
  the GEMM multiplied them (autocast's rounding) and W's sums accumulated in fp64. The bound is
  :func:`~attnchecker.abft.tolerance.gemm_terms`'s rounding-tight one (:func:`row_abs` times the
  row's L1 norm sum_{o in g} |y_to|, plus :func:`row_factor` times the magnitude, by
  Cauchy-Schwarz on the augmented vectors [x_t, 1] and [W_o, b_o]:
  sum_{o in g} (sum_k |x_tk W_ok| + |b_o|) <= sqrt(n) (||x_t|| + 1) ||[W_g | b_g]||_F). Up to
  ``max_rows`` worst rows are recomputed (one element, a token row, 2D blocks spanning up to
  ``max_rows`` tokens).
- columns: a range check that needs no reference, |sum_t y_to| <= sum_t (||x_t|| + 1)
  ||[W_o | b_o]|| per output o (Cauchy-Schwarz again; a 1/64 relative slack covers the rounding
  of the sums). The column of each projection furthest past its bound is recomputed over all
  tokens (one GEMM for all the projections) when it breaks it. This locates and repairs extreme
  whole-column errors (INF, NaN, near-INF, large), which flag every row.
- after the repairs every row is checked again: whatever still fails (a block beyond the budget,
  a second bad column, an input x that was already bad) is reported ``lost``, never repaired.

The heads' checks (scores, probabilities, context) are in :mod:`~attnchecker.attention.heads`.

Each check returns float32 records [flagged rows, flagged columns, value, lost, reproduced], one
per site;
the state adds a layer's records to its device log in one go
(:data:`~attnchecker.attention.state.RECORD_FIELDS`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from attnchecker.abft.cast import round_as
from attnchecker.abft.tolerance import (
    CAP,
    gemm_terms,
    norm_bound,
    squares_lost,
    underflow_floor,
)
from attnchecker.attention import regions
from attnchecker.attention.impl import CheckImpl
from attnchecker.kernels.constants import device_constant

__all__ = [
    "Projection",
    "WeightSums",
    "detected",
    "log_rows",
    "no_autocast",
    "projection_check_",
    "record",
    "row_abs",
    "row_factor",
    "row_floor",
    "row_limits",
    "weight_sums",
]


def no_autocast(device: torch.device) -> torch.autocast:
    """The checks' sums run in fp32 whatever autocast says."""
    return torch.autocast(device.type, enabled=False)


def record(rows: Tensor, cols: Tensor, value: Tensor, lost: Tensor, again: Tensor) -> Tensor:
    """(n, 5) float32 records [rows, cols, value, lost, reproduced] from float32 n-vectors or
    0-dim tensors (``lost`` and ``again`` may be bool). ``reproduced``: a recomputation from the
    operands gave a flagged result again, so the operands themselves imply it (numerics, or a
    fault upstream), not this GEMM."""
    f32 = torch.float32
    return torch.stack([rows, cols, value, lost.to(f32), again.to(f32)], -1).view(-1, 5)


def detected(rec: Tensor) -> Tensor:
    """(n, 1) bool: which of the (n, 5) records of :func:`record` detected something: flagged
    rows, flagged columns (a column breaking its range bound), or a lost result (a record with
    column flags alone must keep its ``lost`` and ``reproduced``)."""
    return ((rec[:, :2] > 0) | (rec[:, 3:4] > 0)).any(1, keepdim=True)


def log_rows(rec: Tensor, det: Tensor, step: Tensor) -> Tensor:
    """(n, 7) float64 rows of ``RECORD_FIELDS`` (``attention.state``) from (n, 5) records, their
    (n, 1) ``det`` and the clock ``step`` (1,): zero where ``det`` is false (a NaN value of an
    undetected check must not leak into the sums)."""
    full = torch.cat([rec.to(torch.float64), det, step.view(1, 1).expand(rec.shape[0], 1)], 1)
    return torch.where(det, full, 0.0)


# --------------------------------------------------------------------------------- projections


@dataclass(frozen=True)
class Projection:
    """A projection y = x W^T + b as the check sees it: its parameters, its weight layout and how
    its N outputs split into sites (P parts, e.g. Q|K|V of a fused projection) and head groups:
    contiguous, or ``interleaved`` in one block per K/V group, [the query heads of group g | k_g
    | v_g] (Megatron-LM's ``linear_qkv``; GPT-NeoX's [q_h | k_h | v_h]: one query head a group).
    ``lead`` / ``trail`` head groups before / after the sites hold features no site names
    (timm's ``ParallelScalingBlock``: the MLP's input): the same GEMM, checked with the sites and
    counted with the first (as the backward GEMMs are named by it, ``dx.q`` / ``dw.q``)."""

    weight: Tensor  # (N, K); (K, N) for GPT-2's Conv1D
    bias: Tensor | None  # (N,)
    conv1d: bool
    sites: tuple[str, ...]
    groups: int  # head groups over the N outputs (the sites', lead and trail)
    site_groups: tuple[int, ...] = ()  # groups of each site when not equal (Phi-3's Q|K|V, GQA)
    interleaved: bool = False
    lead: int = 0
    trail: int = 0

    @property
    def per_site(self) -> tuple[int, ...]:
        """Head groups of each site: equal parts unless ``site_groups`` says otherwise."""
        inner = self.groups - self.lead - self.trail
        return self.site_groups or (inner // len(self.sites),) * len(self.sites)

    @property
    def counted(self) -> tuple[int, ...]:
        """Head groups each site's record counts: the first site's with ``lead`` and ``trail``."""
        return (self.per_site[0] + self.lead + self.trail, *self.per_site[1:])

    @property
    def blocks(self) -> int:
        """The interleaved sites' blocks (K/V groups: every site's heads divide into them)."""
        return math.gcd(*self.per_site) if self.interleaved else 1

    def site_widths(self, n: int) -> tuple[int, ...]:
        """Output features of each site, of the n outputs."""
        return tuple(g * (n // self.groups) for g in self.per_site)

    def group_order(self) -> tuple[int, ...] | None:
        """The head groups in the order of :attr:`counted` (each site's heads in order), or None
        when that is their own order."""
        if not self.interleaved and not self.trail:
            return None
        per, n = self.per_site, self.blocks
        size = [g // n for g in per]  # heads of each site in one block
        order = list(range(self.lead))
        for s, g in enumerate(per):
            at = self.lead + sum(size[:s])  # where site s starts in the first block
            order += [at + (j // size[s]) * sum(size) + j % size[s] for j in range(g)]
            if s == 0:
                order += range(self.lead + sum(per), self.groups)  # the trail
        return tuple(order)

    def rows(self, x: Tensor) -> Tensor:
        """Output rows for input rows x (R, K), with the module's op (same dtype under autocast)."""
        if self.conv1d:
            return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        return F.linear(x, self.weight, self.bias)


class WeightSums(NamedTuple):
    """Weight-derived operands of the row and column checks of the projections of one input,
    stacked as one projection of N outputs in G head groups (fp32).

    Recomputed at every call, never cached: fused optimizers (``torch._fused_adamw_``, the
    Trainer's default) update parameters without bumping their version counter, so no cheap key
    says when a cache is stale (a stale sum is a false alarm on every row)."""

    sums: Tensor  # (K, G): W summed over each group's outputs
    bias: Tensor | None  # (G,): b summed over each group
    norms: Tensor  # (G,): ||[W_g | b_g]||_F, plus an absolute floor (see projection_check_)
    cols: Tensor  # (N,): ||[W_o | b_o]|| of each output, plus the floor


def _stacked(projs: Sequence[Projection]) -> tuple[Tensor, Tensor | None]:
    """The weights and biases of ``projs`` as one projection (a copy only when several)."""
    if len(projs) == 1:
        return projs[0].weight, projs[0].bias
    w = torch.cat([p.weight for p in projs], 1 if projs[0].conv1d else 0)
    if all(p.bias is None for p in projs):
        return w, None
    n = [p.weight.shape[1 if p.conv1d else 0] for p in projs]
    biases = [
        p.weight.new_zeros(m) if p.bias is None else p.bias for p, m in zip(projs, n, strict=True)
    ]
    return w, torch.cat(biases)


def weight_sums(
    weight: Tensor, bias: Tensor | None, *, conv1d: bool, groups: int, floor: float
) -> WeightSums:
    """The sums of a projection's parameters (weight (N, K), (K, N) for Conv1D), with ``floor``
    added to the norms."""
    G, f32 = groups, torch.float32
    with torch.no_grad(), no_autocast(weight.device):
        if conv1d:  # the sums accumulated in fp64, rounded once (the references' u_32 m)
            sums = weight.view(weight.shape[0], G, -1).sum(-1, dtype=torch.float64).to(f32)
            # (N,): a norm over dim 0 runs strided, 3x slower than w * w summed (and square()
            # is pow, slower than mul, on CPU)
            w32 = weight.to(f32)
            cols = torch.mul(w32, w32).sum(0).sqrt_()
            cols.add_(squares_lost(weight.shape[0]))
        else:
            sums = weight.view(G, -1, weight.shape[-1]).sum(1, dtype=torch.float64).to(f32).t()
            cols = norm_bound(weight, 1)
        bsum = None
        if bias is not None:
            cols = torch.hypot(cols, bias.to(f32))
            bsum = bias.view(G, -1).sum(-1, dtype=torch.float64).to(f32)
        norms = norm_bound(cols.view(G, -1), 1).add_(floor)
        return WeightSums(sums, bsum, norms, cols.add_(floor))


def row_factor(x: Tensor, items: list[tuple[Projection, Tensor]], scale: float) -> float:
    """The factor c of the magnitude term c (||x_t|| + 1) ||[W_g | b_g]||_F of a row's bound for
    every projection y = x W^T + b of ``items`` (the largest over them): sqrt(n) by
    Cauchy-Schwarz over the n outputs of a group, times f_mag of a (K + 1)-term inner product
    (the bias is the extra term; :func:`~attnchecker.abft.tolerance.gemm_terms`)."""
    K = x.shape[-1]
    return scale * max(
        gemm_terms(y.dtype, y.device, inner=K + 1, length=y.shape[-1] // p.groups)[1]
        * math.sqrt(y.shape[-1] // p.groups)
        for p, y in items
    )


def row_abs(x: Tensor, items: list[tuple[Projection, Tensor]], scale: float) -> float:
    """The factor a of the term a sum_{o in g} |y_to| of a row's bound (the outputs' own
    rounding: f_abs of :func:`~attnchecker.abft.tolerance.gemm_terms`), the largest over
    ``items``."""
    K = x.shape[-1]
    return scale * max(
        gemm_terms(y.dtype, y.device, inner=K + 1, length=y.shape[-1] // p.groups)[0]
        for p, y in items
    )


def row_limits(x: Tensor, items: list[tuple[Projection, Tensor]], scale: float) -> dict:
    """The keyword constants of a row check of the projections ``items`` of input x:
    ``factor`` (:func:`row_factor`), ``floor`` (:func:`row_floor` per unit of factor, added to the
    weight norms) and ``absf`` (:func:`row_abs`)."""
    factor = row_factor(x, items, scale)
    n = max(y.shape[-1] // p.groups for p, y in items)
    return {"factor": factor, "floor": row_floor(items) / factor,
            "absf": row_abs(x, items, scale), "cap": CAP * math.sqrt(n)}  # fmt: skip


def row_floor(items: list[tuple[Projection, Tensor]]) -> float:
    """Absolute slack of a row sum for what underflows (the elements, the GEMM's K + 1 terms)."""
    return max(
        underflow_floor(
            y.dtype, length=y.shape[-1] // p.groups, inner=p.weight.shape[0 if p.conv1d else 1] + 1
        )
        for p, y in items
    )


def index_constant(values: tuple[int, ...], device: torch.device) -> Tensor:
    """(len(values),) int64 ``values`` on ``device``: a :func:`device_constant`."""
    return device_constant(("index", values), device, lambda: torch.tensor(values, device=device))


def _segments(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """(sum(sizes), len(sizes)) float32 indicator of consecutive segments: a
    :func:`device_constant`."""

    def make() -> Tensor:
        ind = torch.zeros(sum(sizes), len(sizes), device=device)
        start = 0
        for i, n in enumerate(sizes):
            ind[start : start + n, i] = 1.0
            start += n
        return ind

    return device_constant(("segments", sizes), device, make)


def _per_site(flags: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """(S,) float32: how many rows of ``flags`` (T, sum(sizes)) have a flag in each segment."""
    if len(sizes) == 1:
        return flags.any(1).sum(0, dtype=torch.float32).view(1)
    if len(set(sizes)) == 1:
        return flags.view(flags.shape[0], len(sizes), -1).any(-1).sum(0, dtype=torch.float32)
    seg = _segments(sizes, flags.device)
    return (flags.to(torch.float32) @ seg).gt(0).sum(0, dtype=torch.float32)


def _site_order(
    projs: Sequence[Projection], widths: Sequence[int], device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """Index permutations of the stacked head groups (sum G,) and outputs (sum N,) into the
    order the records count them (:meth:`Projection.group_order`), for the per-site counts;
    None where that is theirs (a cached constant)."""
    orders_of = [p.group_order() for p in projs]
    if all(o is None for o in orders_of):
        return None
    key = ("order", *zip([p.groups for p in projs], orders_of, widths, strict=True))

    def order(part: int) -> Tensor:  # 0: the groups' order, 1: the outputs'
        g_order, n_order, g0, n0 = [], [], 0, 0
        for p, o, n in zip(projs, orders_of, widths, strict=True):
            w, seq = n // p.groups, range(p.groups) if o is None else o
            g_order += [g0 + g for g in seq]
            n_order += [n0 + g * w + j for g in seq for j in range(w)]
            g0, n0 = g0 + p.groups, n0 + n
        return torch.tensor(n_order if part else g_order, device=device)

    groups = device_constant((*key, "groups"), device, lambda: order(0))
    return groups, device_constant((*key, "outputs"), device, lambda: order(1))


def _columns(weight: Tensor, bias: Tensor | None, conv1d: bool, x: Tensor, f: Tensor) -> Tensor:
    """Output features ``f`` (P,) of a projection for every input row of x (T, K): (T, P),
    with the module's op (same dtype under autocast)."""
    w = weight.index_select(1, f) if conv1d else weight.index_select(0, f).t()
    return x @ w if bias is None else torch.addmm(bias.index_select(0, f), x, w)


def _worst_columns(ratio: Tensor, widths: list[int]) -> tuple[Tensor, Tensor]:
    """(P,) values and indices into ``ratio`` (sum(widths),) of each segment's largest
    (NaN ranks first)."""
    P = len(widths)
    if len(set(widths)) == 1:
        vals, idx = ratio.view(P, -1).max(1)
        return vals, idx if P == 1 else idx + _offsets(widths, ratio.device)
    parts = [part.max(0, keepdim=True) for part in ratio.split(widths)]
    offsets = [0, *itertools.accumulate(widths)][:-1]
    idx = [i + o for (_, i), o in zip(parts, offsets, strict=True)]
    return torch.cat([v for v, _ in parts]), torch.cat(idx)


def _offsets(widths: list[int], device: torch.device) -> Tensor:
    """(P,) int64 start of each segment (a cached constant in eager, a graph constant under
    torch.compile)."""
    return index_constant(tuple([0, *itertools.accumulate(widths)][:-1]), device)


def _count(flags: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """(S,) float32: the flags of ``flags`` (sum(sizes),) in each segment."""
    if len(sizes) == 1:
        return flags.sum(dtype=torch.float32).view(1)
    if len(set(sizes)) == 1:
        return flags.view(len(sizes), -1).sum(1, dtype=torch.float32)
    return flags.to(torch.float32) @ _segments(sizes, flags.device)


def projection_check_(
    x: Tensor,
    items: Sequence[tuple[Projection, Tensor]],
    *,
    max_rows: int,
    factor: float,
    floor: float,
    absf: float,
    cap: float,
    bounds: bool = False,
    how: CheckImpl = CheckImpl.EAGER,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Check and repair in place the outputs y (B, L, N_i) = x (B, L, K) W_i^T + b_i of the
    projections of one input (head groups of one width); see the module docstring.

    ``factor`` (:func:`row_factor`) times the magnitude bound plus ``absf`` (:func:`row_abs`)
    times the row's L1 norm is the tolerance of a row sum; ``floor`` is added to the weight
    norms. Returns the records (one per site, in order), the row references (T, sum G) and,
    with ``bounds``, the tolerances (T, sum G) of the delivered rows' sums: what the attention
    core may take from here (``mode="passing"``).
    ``how``: as its aten ops or compiled (:func:`~attnchecker.attention.regions.run`).
    """
    kw = {"max_rows": max_rows, "factor": factor, "floor": floor, "absf": absf, "cap": cap,
          "bounds": bounds}  # fmt: skip
    # the outputs as .data: written in place behind autograd's back (a compiled region would
    # otherwise write its input, an output of a custom Function, through autograd)
    items = [(p, y.data) for p, y in items]
    return regions.run(_projection_region, how, x, items, **kw)


def _projection_region(
    x: Tensor,
    items: list[tuple[Projection, Tensor]],
    *,
    max_rows: int,
    factor: float,
    floor: float,
    absf: float,
    cap: float,
    bounds: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    B, L, K = x.shape
    T, R = B * L, min(max_rows, B * L)
    projs = [p for p, _ in items]
    ys = [y.data.view(T, y.shape[-1]) for _, y in items]  # (T, N_i), written in place
    x2 = x.reshape(T, K)
    f32 = torch.float32
    G = sum(p.groups for p in projs)
    groups = tuple(g for p in projs for g in p.counted)  # counted by each site's record
    widths = tuple(g * (y.shape[-1] // p.groups) for p, y in zip(projs, ys, strict=True)
                   for g in p.counted)  # fmt: skip
    weight, bias = _stacked(projs)
    low = ys[0].dtype  # what the GEMM multiplied: x, W and b rounded to it (autocast), in fp32
    wm, bm = (None if t is None else round_as(t, low) for t in (weight, bias))
    ws = weight_sums(wm, bm, conv1d=projs[0].conv1d, groups=G, floor=floor)
    cat = (lambda ts, dim: ts[0]) if len(ys) == 1 else torch.cat
    with no_autocast(x.device):
        xn1 = norm_bound(x2, 1, keepdim=True).add_(1)  # (T, 1)
        # the reference GEMM in fp32 (x as the GEMM multiplied it: exact in fp32)
        xf = round_as(x2, low).float()
        ref = xf @ ws.sums if ws.bias is None else torch.addmm(ws.bias, xf, ws.sums)

        def rows_check() -> tuple[Tensor, Tensor, Tensor]:
            """(residual, excess, tolerance) (T, G): excess > 0 or NaN where flagged."""
            pairs = zip(projs, ys, strict=True)
            rec = cat([y.view(T, p.groups, -1).sum(-1, dtype=f32) for p, y in pairs], 1)
            pairs = zip(projs, ys, strict=True)
            norm1 = torch.linalg.vector_norm
            l1 = cat([norm1(y.view(T, p.groups, -1), 1, dim=-1, dtype=f32) for p, y in pairs], 1)
            mag = xn1 * ws.norms  # the magnitude bound per unit of sqrt(n) (CAP: at most that)
            l1 = torch.minimum(l1, mag * cap)
            d = rec - ref
            tol = torch.add(l1.mul_(absf), mag, alpha=factor)
            return d, d.abs().sub_(tol), tol

        order = _site_order(projs, [y.shape[-1] for y in ys], x.device)

        def site_major(flags: Tensor, which: int) -> Tensor:
            return flags if order is None else flags.index_select(-1, order[which])

        d, excess, tol = rows_check()
        n_rows = _per_site(site_major(~(excess <= 0), 0), groups)
        # Columns: |sum_t y_to| <= sum_t (||x_t|| + 1) ||[W_o | b_o]||, with a 1/64 relative
        # slack for the rounding of the sums; the worst column of each projection is the one
        # furthest past its bound.
        ratio = cat([y.sum(0, dtype=f32) for y in ys], 0).abs_().div_(ws.cols)  # (N,)
        xs = xn1.sum() * (1 + 2**-6)
        bad_c = ~(ratio <= xs)
        n_cols = _count(site_major(bad_c, 1), widths)
        vals, cols = _worst_columns(ratio, [y.shape[-1] for y in ys])  # (P,) each
        hits = ~(vals <= xs)

    # Rows: the R worst tokens, recomputed for every projection of this input.
    top, idx = excess.amax(1).topk(R)  # NaN ranks first
    take = ~(top <= 0)[:, None]  # (R, 1)
    xr = x2.index_select(0, idx)  # (R, K)
    for p, y in zip(projs, ys, strict=True):
        y.index_copy_(0, idx, torch.where(take, p.rows(xr).to(y.dtype), y.index_select(0, idx)))
    # Columns: the worst column of each projection, when it breaks the range bound, all
    # recomputed over every token by one GEMM.
    new = _columns(weight, bias, projs[0].conv1d, x2, cols)  # (T, P)
    start = 0
    for i, y in enumerate(ys):
        f, start = cols[i : i + 1] - start, start + y.shape[-1]
        y.index_copy_(
            1, f, torch.where(hits[i], new[:, i : i + 1].to(y.dtype), y.index_select(1, f))
        )

    # The delivered error: the signed residual of the worst row (INF, NaN, its size).
    value = d.view(-1).index_select(0, excess.view(-1).argmax().view(1)).expand(len(groups))
    # Repaired only if every row passes now: a block beyond the budget, a second column, or an
    # input x that was already bad (recomputing repeats the fault) leave rows flagged.
    with no_autocast(x.device):
        still = ~(rows_check()[1] <= 0)  # (T, G)
        lost = _per_site(site_major(still, 0), groups) > 0
        again = (still.index_select(0, idx) & take).any()  # a recomputed row flagged again
    bound = tol if bounds else None
    return record(n_rows, n_cols, value, lost, again.expand(len(groups))), ref, bound
