"""Triton helpers the checked kernels share: tiles, counters and the fault a launch injects.

Module globals a kernel reads must be ``tl.constexpr`` (the compiler rejects plain Python
values; the interpreter does not): host code reads the plain tables (:data:`SITE_CODES`,
``attnchecker.kernels.CHECKS``), the kernels their constexpr copies.

A fault is a float32 vector (site, batch * head, row, col, value, persistent, mode, bit):
row or col -1 hits every row / column (patterns 1C / 1R); ``mode`` is a code of
:data:`attnchecker.faults.MODES`: set to ``value``, multiply by it, flip ``bit`` of the fp32
value, or flip the reference exponent bit (bit 30 where |x| < 2, else 29: the published study's
fault). The modes, the rule's constants and each fault kind's (mode, value) are defined once, in
:mod:`attnchecker.faults`, which the eager sites use too.

A fault is applied to the product a GEMM delivered, never to its operands: a recomputation
multiplies operands re-read from memory, so a transient fault of the first product is not in it
by construction (a persistent one is applied to every product of its site).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnchecker.faults import EXPONENT_LIMIT, MODES, TOP_EXPONENT_BIT
from attnchecker.kernels import CHECKS

FAULT_FIELDS = ("site", "bh", "row", "col", "value", "persistent", "mode", "bit")

# the fault modes and the reference exponent rule (attnchecker.faults) as kernel constants
_SET = tl.constexpr(MODES["set"])
_SCALE = tl.constexpr(MODES["scale"])
_EXPONENT = tl.constexpr(MODES["exponent"])
_TOP_BIT = tl.constexpr(TOP_EXPONENT_BIT[torch.float32])  # the tile is fp32
_LIMIT = tl.constexpr(EXPONENT_LIMIT)

SITE_CODES = {"s": 1, "pv": 2, "st": 3, "dpt": 4, "dv": 5, "dk": 6, "sq": 7, "dp": 8, "dq": 9}
"""The code of each GEMM a fault can hit (0: none), as the FAULT vector carries it."""

TAU_ABS = tl.constexpr(1e-30)
"""Absolute floor of every kernel tolerance: subnormal P and flush-to-zero (a measured
false-alarm trap, ``../shared/spec/fused-attention.md`` section 1)."""


def row(check: str) -> tl.constexpr:
    """The counters' row of a kernel check, as a kernel constant."""
    return tl.constexpr(CHECKS.index(check))


def site(name: str) -> tl.constexpr:
    return tl.constexpr(SITE_CODES[name])


@triton.jit
def load_fault(FAULT, INJECT: tl.constexpr):
    """(site, bh, row, col, value, persistent, mode, bit); site 0 (none) without INJECT."""
    site, bh, row, col, val, keep, mode, bit = 0, -1, -1, -1, 0.0, 0, 0, 0
    if INJECT:
        site = tl.load(FAULT).to(tl.int32)
        bh = tl.load(FAULT + 1).to(tl.int32)
        row = tl.load(FAULT + 2).to(tl.int32)
        col = tl.load(FAULT + 3).to(tl.int32)
        val = tl.load(FAULT + 4)
        keep = tl.load(FAULT + 5).to(tl.int32)
        mode = tl.load(FAULT + 6).to(tl.int32)
        bit = tl.load(FAULT + 7).to(tl.int32)
    return site, bh, row, col, val, keep, mode, bit


@triton.jit
def transposed(fault):
    """The fault as a transposed tile (S^T, dP^T: keys by queries) takes it: its row is a
    query and its column a key (:class:`~attnchecker.kernels.flash.KernelFault`), which index
    that tile's columns and rows."""
    f_site, f_bh, f_row, f_col, f_val, f_keep, f_mode, f_bit = fault
    return f_site, f_bh, f_col, f_row, f_val, f_keep, f_mode, f_bit


@triton.jit
def at(offs, index):
    """Which of ``offs`` the fault's row or column ``index`` selects (-1: all)."""
    return (index == -1) | (offs == index)


@triton.jit
def corrupt(x, hit, val, mode, bit):
    """x (fp32) with the fault applied where ``hit``."""
    top = tl.where(tl.abs(x) < _LIMIT, _TOP_BIT, _TOP_BIT - 1)
    b = tl.where(mode == _EXPONENT, top, bit)
    flipped = (x.to(tl.int32, bitcast=True) ^ (1 << b)).to(tl.float32, bitcast=True)
    new = tl.where(mode == _SET, val, tl.where(mode == _SCALE, x * val, flipped))
    return tl.where(hit, new, x)


@triton.jit
def inject(x, fault, code, bh, rows, cols, recompute, on):
    """The product x (len(rows), len(cols)) of GEMM ``code`` with ``fault`` applied where it
    hits (its (batch, head) ``bh``, row and column) and ``on`` holds; in a ``recompute`` (> 0)
    only when persistent."""
    f_site, f_bh, f_row, f_col, f_val, f_keep, f_mode, f_bit = fault
    hit = (f_site == code) & (f_bh == bh) & on & ((recompute == 0) | (f_keep != 0))
    hit = hit & at(rows, f_row)[:, None] & at(cols, f_col)[None, :]
    return corrupt(x, hit, f_val, f_mode, f_bit)


@triton.jit
def tile(base, rows, row_stride, cols, col_stride, mask, UPCAST: tl.constexpr, FRESH: tl.constexpr):
    """A (len(rows), len(cols)) tile at ``base`` (a pointer already offset, in 64 bits, to the
    tile's first row: the in-tile offsets stay small). ``FRESH``: a volatile load, which the
    compiler may neither merge with an earlier load nor hoist, so a GEMM of it is a real
    recomputation (two GEMMs of one loaded value are one after common-subexpression
    elimination). ``UPCAST``: to fp32 (the interpreter cannot compute in bf16)."""
    x = tl.load(base + rows[:, None] * row_stride + cols[None, :] * col_stride, mask=mask,
                other=0.0, volatile=FRESH)  # fmt: skip
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):  # fmt: skip
    """(len(offs_m), len(offs_n)) bool: query rows that may attend keys."""
    ok = (offs_m[:, None] < L) & (offs_n[None, :] < LK)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + shift)
    if WINDOW:
        ok = ok & (offs_n[None, :] > offs_m[:, None] + shift - window)
    if HAS_MASK:
        keep = tl.load(KMASK + b * smb + offs_n, mask=offs_n < LK, other=0)
        ok = ok & (keep[None, :] != 0)
    return ok


@triton.jit
def tile_check(x, a_bar, a_mag, b_tile, ok, tau):
    """Columns of the tile x = A B^T (A's rows summed into a_bar, |A|'s into a_mag) whose sum
    is off its reference a_bar . b_i beyond tau a_mag . |b_i| (+ TAU_ABS), among ``ok``."""
    b32 = b_tile.to(tl.float32)
    ref = tl.sum(b32 * a_bar[None, :], 1)
    bound = tau * tl.sum(tl.abs(b32) * a_mag[None, :], 1) + TAU_ABS
    return tl.sum((fails(tl.sum(x, 0) - ref, bound) & ok).to(tl.int32), 0)


@triton.jit
def fresh_product(a_at, a_rows, a_stride, a_mask, b_at, b_rows, b_stride, b_mask, cols, a_col,
                  b_col, UPCAST: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """A B^T of the tiles A at ``a_at`` and B at ``b_at`` (as :func:`tile` reads them) re-read
    from memory: the recomputation of a product that failed its check, which the compiler
    cannot merge with the first."""
    a = tile(a_at, a_rows, a_stride, cols, a_col, a_mask, UPCAST, True)
    b = tile(b_at, b_rows, b_stride, cols, b_col, b_mask, UPCAST, True)
    return tl.dot(a, tl.trans(b), input_precision=DOT)


@triton.jit
def count(COUNTS, check, column):
    """Add 1 to the counter (``check``, column: 0 detected, 1 corrected, 2 uncorrected)."""
    tl.atomic_add(COUNTS + check * 3 + column, 1)


@triton.jit
def fails(residual, bound):
    """Where |residual| <= bound does not hold (a NaN residual fails)."""
    return ~(tl.abs(residual) <= bound)


# The blocks the three attention kernels share, each defined once so that a check, its
# recomputation and its counters read (and compile) alike in every kernel. A @triton.jit helper
# is inlined where it is called: no call, no extra live values beyond what it returns.


@triton.jit
def program_block(HEADS, N, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """What program (i, j) of a grid (blocks of BLOCK rows of N, batch * HEADS) owns: rows
    i * BLOCK .. of (batch, head) j (query rows in the forward and dQ kernels, keys in dK/dV).
    Returns (j, b, h, start, offs (BLOCK,), offs_d (BLOCK_D,), ok (BLOCK,), d_ok (BLOCK_D,),
    mask (BLOCK, BLOCK_D)); b and h are 64-bit: they scale whole-tensor strides (a tensor may
    hold more than 2^31 elements)."""
    start = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b = (bh // HEADS).to(tl.int64)
    h = (bh % HEADS).to(tl.int64)
    offs = start + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    ok = offs < N
    d_ok = offs_d < D
    return bh, b, h, start, offs, offs_d, ok, d_ok, ok[:, None] & d_ok[None, :]


@triton.jit
def key_range(row0, L, LK, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(shift, lo, hi): query i sits at key position i + shift (a KV cache makes LK > L); the
    key tiles from lo to hi are all that rows row0 .. row0 + BLOCK_M may attend (causal: none
    past the last row's position; a window: none before the first row's reach)."""
    shift = LK - L
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, row0 + BLOCK_M + shift)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, (row0 + shift - window + 1) // BLOCK_N * BLOCK_N)
    return shift, lo, hi


@triton.jit
def sums(x):
    """(sum of x's rows, sum of |x|'s rows) in fp32, each (x.shape[1],): the references
    :func:`tile_check` needs of the operand a program keeps (two vectors, not an |x| tile kept
    live across the loop: registers)."""
    x32 = x.to(tl.float32)
    return tl.sum(x32, 0), tl.sum(tl.abs(x32), 0)


@triton.jit
def accumulate(w, x, acc, fault, code, bh, rows, cols, attempt, on,
               INJECT: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """acc + w x in fp32 (acc (len(w), x.shape[1]); None: w x alone), GEMM ``code`` of (batch,
    head) ``bh``, with the fault (:func:`inject`) applied at its global indices ``rows`` x
    ``cols`` where ``on`` holds: an accumulator is hit once, after the sweep's first tile."""
    acc = tl.dot(w, x, acc, input_precision=DOT)
    if INJECT:
        acc = inject(acc, fault, code, bh, rows, cols, attempt, on)
    return acc


@triton.jit
def product(a, b, fault, code, bh, rows, cols, attempt, INJECT: tl.constexpr, DOT: tl.constexpr):
    """a b^T (len(a), len(b)) in fp32: :func:`accumulate` of a tile product, which the fault
    hits whichever tile it is in."""
    return accumulate(a, tl.trans(b), None, fault, code, bh, rows, cols, attempt, True, INJECT,
                      DOT)  # fmt: skip


@triton.jit
def checked_product(a, b, a_src, b_src, a_bar, a_mag, b_ok, tau, fault, code, bh, rows, cols,
                    attempt, COUNTS, check, CHECK: tl.constexpr, INJECT: tl.constexpr,
                    UPCAST: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """:func:`product` a b^T, with CHECK its columns checked (:func:`tile_check`: a_bar, a_mag
    from :func:`sums` of a; b_ok: which rows of b count). A failing product is counted detected
    (counter row ``check``), recomputed once from a and b re-read from memory (``a_src``,
    ``b_src``: (pointer, in-tile rows, row stride, columns, column stride, mask), as
    :func:`tile` read them: :func:`fresh_product`) and checked again: corrected, or still
    failing and uncorrected (the recomputation is returned either way)."""
    x = product(a, b, fault, code, bh, rows, cols, attempt, INJECT, DOT)
    if CHECK and tile_check(x, a_bar, a_mag, b, b_ok, tau) > 0:
        count(COUNTS, check, 0)
        a_at, a_rows, a_stride, feats, a_col, a_mask = a_src
        b_at, b_rows, b_stride, _feats, b_col, b_mask = b_src
        x = fresh_product(a_at, a_rows, a_stride, a_mask, b_at, b_rows, b_stride, b_mask,
                          feats, a_col, b_col, UPCAST, DOT)  # fmt: skip
        if INJECT:  # a recomputation: a transient fault is not in it, a persistent one is
            x = inject(x, fault, code, bh, rows, cols, 1, True)
        still = tile_check(x, a_bar, a_mag, b, b_ok, tau) > 0
        count(COUNTS, check, 1 + still.to(tl.int32))
    return x


@triton.jit
def carry(c, t, w, w_mag, x):
    """The checksum c and bound t (len(w),) of a deferred check of acc += w x, one tile on:
    (c + sum_j w_ij (x_j . 1), t + sum_j w_mag_ij (|x_j| . 1)); w (fp32) as it entered the
    MMA, w_mag = |w| (or w itself where w >= 0: the bound is then exact and costs no abs)."""
    x32 = x.to(tl.float32)
    c = c + tl.sum(w * tl.sum(x32, 1)[None, :], 1)
    t = t + tl.sum(w_mag * tl.sum(tl.abs(x32), 1)[None, :], 1)
    return c, t


@triton.jit
def off_rows(acc, c, t, tau, ok):
    """How many rows of the accumulator acc (R, BLOCK_D), among ``ok`` (R,), sum to other than
    their carried checksum c (R,) beyond tau times the carried bound t (+ TAU_ABS)."""
    return tl.sum((fails(tl.sum(acc, 1) - c, tau * t + TAU_ABS) & ok).to(tl.int32), 0)


@triton.jit
def tally(COUNTS, checks, found, attempt, first):
    """The counters of a program's deferred checks (``checks``: their counter rows, a tuple of
    constants) whose sweep ``attempt`` (0, or the one re-run) found ``found[i]`` failing rows
    each: (first: bit i set where check i failed at attempt 0, todo: 1 where any did, so that
    the loop runs once more; a re-run is idempotent, the inputs read-only). In the re-run a
    check that failed at first is corrected, or still failing (uncorrected). One branch on
    ``attempt`` for all the checks: a branch per check cost the dQ kernel up to 24 more
    registers (measured, ptxas sm_90)."""
    code = 0
    for i in tl.static_range(len(checks)):
        code += (1 << i) * (found[i] > 0).to(tl.int32)
    todo = 0
    if attempt == 0:
        first = code
        for i in tl.static_range(len(checks)):
            if found[i] > 0:
                count(COUNTS, checks[i], 0)
        if code > 0:
            todo = 1
    else:
        for i in tl.static_range(len(checks)):
            if (first >> i) % 2 == 1:
                count(COUNTS, checks[i], 1 + (found[i] > 0).to(tl.int32))
    return first, todo
