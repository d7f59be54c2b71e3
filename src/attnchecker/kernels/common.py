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
