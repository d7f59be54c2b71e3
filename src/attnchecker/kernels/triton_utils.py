"""Triton helpers the check kernels share: the GEMM check's
(:mod:`~attnchecker.kernels.gemm_check`), the projection check's
(:mod:`~attnchecker.kernels.projection_check`) and the SDPA route's
(:mod:`~attnchecker.kernels.sdpa_kernels`, :mod:`~attnchecker.kernels.sdpa_kernels_bwd`).

These kernels check a GEMM from outside it (a pass over its output and operands, a repair on
a flag), so their helpers are tiles with separate row and column masks, 64-bit spans, the
recomputation of a block of rows and the worst residual of a record; the SDPA route's kernels
add the reduced K/V ranges, the records' claims and a block's scores. The fused flash kernels'
helpers, which check GEMMs from inside (faults, counters, tile checks), are
:mod:`~attnchecker.kernels.common`'s.

On a CPU the kernels run only in Triton's interpreter, which computes through numpy (no bf16):
:func:`readable` gives them fp32 copies of bf16 tensors there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.kernels import interpreting
from attnchecker.kernels.launches import as_on_gpu

__all__ = [
    "EPS32", "EPS32_K", "add_record", "as_i64", "block_d", "block_product", "block_scores",
    "dot", "head_stats", "mark_lost", "mask_view", "popcount16", "readable", "row_view", "span",
    "tile", "use_ieee", "words", "worst_residual",
]  # fmt: skip

_F32 = torch.float32
EPS32 = torch.finfo(_F32).eps
EPS32_K = tl.constexpr(1.1920928955078125e-07)  # fp32's eps (EPS32), inside the kernels


# ------------------------------------------------------------------------------ tiles and spans


@triton.jit
def tile(P, r, c, s_r, s_c, rmask, cmask):
    """The (len(r), len(c)) tile of P at rows r and columns c (strides s_r, s_c), 0 outside."""
    return tl.load(P + r[:, None] * s_r + c[None, :] * s_c, mask=rmask[:, None] & cmask[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def rounded(t, ROUND: tl.constexpr):
    """fp32 ``t`` rounded as the GEMM's operand was (``ROUND``: 0 none, 1 to bf16, 2 to fp16),
    back in fp32: bf16 by round-to-nearest-even on the bits (the interpreter's cast truncates,
    a GPU's rounds to nearest; the bits give both the GPU's and torch's ``.to(bfloat16)``)."""
    if ROUND == 1:
        u = t.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    elif ROUND == 2:
        return t.to(tl.float16).to(tl.float32)
    else:
        return t


@triton.jit
def as_i64(v):
    """v as a 64-bit scalar (an int argument may be a constexpr)."""
    return v + tl.zeros([], dtype=tl.int64)


@triton.jit
def span(start, n, BLOCK: tl.constexpr):
    """(start + 0 .. BLOCK - 1 as 64-bit offsets, which of them are below n)."""
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    return offs, offs < n


@triton.jit
def block_product(X, Y, rows, rmask, cols, cmask, K, sx_m, sx_k, sy_k, sy_n, IEEE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RX: tl.constexpr,
                  RY: tl.constexpr):  # fmt: skip
    """x[rows] @ y[:, cols], (BM, BN) fp32 accumulators (rows outside rmask: 0), fp32 operands
    in IEEE precision (no TF32: a recomputation must not round more than the GEMM did), each
    operand rounded as the GEMM multiplied it (``RX``, ``RY``: :func:`rounded`'s codes; an fp32
    weight under bf16 autocast)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask = span(k0, K, BK)
        a = tile(X, rows, ks, sx_m, sx_k, rmask, kmask)
        b = tile(Y, ks, cols, sy_k, sy_n, kmask, cmask)
        if IEEE:
            a = rounded(a.to(tl.float32), RX)
            b = rounded(b.to(tl.float32), RY)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b, in IEEE fp32 where IEEE."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def worst_residual(SCR, exc, res, n, BLOCK: tl.constexpr):
    """The residual (at offset ``res`` of SCR) of the largest of the n excesses (at ``exc``), a
    NaN one first (as ``topk`` ranks them): the delivered error a record reports. One program,
    on a flag only."""
    best = tl.full([], -float("inf"), tl.float32)
    value = tl.zeros([], dtype=tl.float32)
    nan = tl.zeros([], dtype=tl.int32)  # a NaN excess seen: its row is the worst
    for m0 in range(0, n, BLOCK):
        ms, mmask = span(m0, n, BLOCK)
        e = tl.load(SCR + (ms + exc), mask=mmask, other=-float("inf"))
        isnan = (e != e).to(tl.int32)
        if nan == 0:
            if tl.max(isnan, 0) > 0:
                nan = 1
                value = tl.load(SCR + (tl.argmax(isnan, 0).to(tl.int64) + m0 + res))
            elif tl.max(e, 0) > best:
                best = tl.max(e, 0)
                value = tl.load(SCR + (tl.argmax(e, 0).to(tl.int64) + m0 + res))
    return value


# ------------------------------------------------------------------------------ the SDPA route's


@triton.jit
def head_stats(STATS, bkv, S, d, ds, dm):
    """(lo, hi, max|k_f|, max ||k_j||, max |v|) of one K/V head from its S partials (as
    ``sdpa_kernels.kv_stats`` writes them)."""
    base = STATS + bkv.to(tl.int64) * S * (3 * d + 2)
    lo = tl.load(base + ds, mask=dm, other=0.0)
    hi = tl.load(base + d + ds, mask=dm, other=0.0)
    ka = tl.load(base + 2 * d + ds, mask=dm, other=0.0)
    kn = tl.load(base + 3 * d)
    va = tl.load(base + 3 * d + 1)
    for s in range(1, S):
        at = base + s * (3 * d + 2)
        lo = tl.minimum(lo, tl.load(at + ds, mask=dm, other=0.0))
        hi = tl.maximum(hi, tl.load(at + d + ds, mask=dm, other=0.0))
        ka = tl.maximum(ka, tl.load(at + 2 * d + ds, mask=dm, other=0.0))
        kn = tl.maximum(kn, tl.load(at + 3 * d))
        va = tl.maximum(va, tl.load(at + 3 * d + 1))
    return lo, hi, ka, kn, va


@triton.jit
def add_record(LOG, row, n_rows, n_cols, value, step):
    """Add one call's record of a check to ``LOG[row]`` (-1: not recorded): flagged rows and
    columns, the delivered value, detected, the step. One program a call writes it (the
    caller elects it by a rule that does not depend on program order)."""
    if row >= 0:
        at = LOG + row * 7
        tl.atomic_add(at, n_rows.to(tl.float64))
        tl.atomic_add(at + 1, n_cols.to(tl.float64))
        tl.atomic_add(at + 2, value.to(tl.float64))
        tl.atomic_add(at + 5, 1.0)
        tl.atomic_add(at + 6, step.to(tl.float64))


@triton.jit
def words(flags, BD: tl.constexpr):
    """(BD,) 0 / 1 flags as BD // 16 int32 words of 16 bits."""
    return tl.sum(tl.reshape(flags, [BD // 16, 16]) << tl.arange(0, 16)[None, :], 1)


@triton.jit
def popcount16(w):
    """Set bits of each 16-bit word."""
    n = tl.zeros(w.shape, dtype=tl.int32)
    for i in tl.static_range(16):
        n += (w >> i) & 1
    return n


@triton.jit
def mark_lost(LOG, row, CLAIM):
    """Mark ``LOG[row]`` lost and reproduced, once a call."""
    if row >= 0:  # noqa: SIM102 (the claim is taken only for a recorded row)
        if tl.atomic_xchg(CLAIM, 1) == 0:
            tl.atomic_add(LOG + row * 7 + 3, 1.0)
            tl.atomic_add(LOG + row * 7 + 4, 1.0)


@triton.jit
def block_scores(q, K, M, rows, cols, rm, cm, ds, dm, sk_l, sk_d, sm_l, sm_k, scale,
                 HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """scale q k^T + mask of a (rows, cols) block: (z (BM, BN) fp32, -inf where excluded, k)."""
    k = tile(K, cols, ds, sk_l, sk_d, cm, dm)
    if IEEE:
        z = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        z = tl.dot(q, tl.trans(k)) * scale
    if HAS_MASK:
        z += tile(M, rows, cols, sm_l, sm_k, rm, cm).to(tl.float32)
    ok = rm[:, None] & cm[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return tl.where(ok, z, -float("inf")), k


# ------------------------------------------------------------------------------ host side


def round_code(operand: torch.dtype, out: torch.dtype) -> int:
    """:func:`rounded`'s ``ROUND`` for an operand of dtype ``operand`` that a GEMM with outputs
    of dtype ``out`` multiplied: rounded to a half-precision output's dtype where wider
    (autocast's cast), else as it is."""
    if operand == out or out not in (torch.bfloat16, torch.float16):
        return 0
    return 1 if out == torch.bfloat16 else 2


def readable(t: Tensor | None) -> Tensor | None:
    """t as the kernels read it: an fp32 copy of a bf16 tensor in the interpreter (unless the
    launches are recorded, not run: :func:`attnchecker.kernels.launches.recorded`)."""
    if t is not None and interpreting() and t.dtype == torch.bfloat16 and not as_on_gpu():
        return t.to(_F32)
    return t


def block_d(d: int) -> int:
    """The feature block of a head size d (a power of two, at least 16)."""
    return max(16, triton.next_power_of_2(d))


def use_ieee(q: Tensor) -> bool:
    """Whether the SDPA route's recomputations multiply in IEEE fp32 (fp32 operands, or the
    interpreter)."""
    return q.dtype == _F32 or interpreting()


def row_view(t: Tensor, like: Tensor) -> Tensor:
    """Per-row facts (B | 1, H | 1, L | 1) as a (B, H, L) view (stride 0 where broadcast)."""
    return t.to(like.device).expand(*like.shape[:3])


def mask_view(mask: Tensor | None, q: Tensor, Lk: int) -> tuple[Tensor, tuple[int, ...], bool]:
    """(the additive mask as a (B, H, L, Lk) view, its strides, whether there is one)."""
    if mask is None:
        z = q.new_zeros(1, dtype=_F32)
        return z, (0, 0, 0, 0), False
    m = readable(mask).expand(*q.shape[:3], Lk)
    return m, m.stride(), True
