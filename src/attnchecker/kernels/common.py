"""Triton helpers the checked kernels share: the fault a launch injects (tests, campaigns).

A fault is a float32 vector (site, batch * head, row, col, value, persistent, mode, bit):
row or col -1 hits every row / column (patterns 1C / 1R); mode 0 sets ``value``, 1 multiplies
by it, 2 flips ``bit`` of the fp32 value, 3 flips the reference exponent bit (bit 30 where
|x| < 2, else 29: the published study's fault, see ``attnchecker.inject.kinds``).
"""

from __future__ import annotations

import triton
import triton.language as tl

FAULT_FIELDS = ("site", "bh", "row", "col", "value", "persistent", "mode", "bit")

MODES = {"set": 0, "scale": 1, "bit": 2, "exponent": 3}


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
    top = tl.where(tl.abs(x) < 2.0, 30, 29)
    b = tl.where(mode == 3, top, bit)
    flipped = (x.to(tl.int32, bitcast=True) ^ (1 << b)).to(tl.float32, bitcast=True)
    new = tl.where(mode == 0, val, tl.where(mode == 1, x * val, flipped))
    return tl.where(hit, new, x)
