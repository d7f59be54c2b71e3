"""Launching the checked flash attention kernels: shapes, tolerances, counters, faults.

    out, lse, counts = flash_forward(q, k, v, causal=True)

q (B, H, L, d), k and v (B, Hkv, Lk, d) with H a multiple of Hkv (GQA / MQA); ``key_mask``
(B, Lk) bool marks the keys each sequence may attend (padding); ``window`` keeps the last
``window`` keys of each query (sliding-window attention). No L x L tensor is ever allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from attnchecker.kernels import interpreting
from attnchecker.kernels.flash_fwd import SITE_PV, SITE_S, _fwd

__all__ = ["CHECKS", "KernelFault", "flash_forward", "new_counts", "tolerance"]

CHECKS = ("s", "pv", "softmax")
"""Rows of the counters: the S tile check, the deferred PV check, the softmax range check;
columns: detected, corrected, uncorrected."""

_SITES = {"s": SITE_S, "pv": SITE_PV}


@dataclass(frozen=True)
class KernelFault:
    """One fault inside a kernel GEMM: ``site`` "s" (S = Q K^T at query ``row``, key ``col``) or
    "pv" (the P V accumulator at query ``row``, feature ``col``, after the first key tile), of
    (``batch``, ``head``); ``persistent`` faults hit every recomputation too."""

    site: str
    batch: int
    head: int
    row: int
    col: int
    value: float
    persistent: bool = False

    def encode(self, heads: int, device: torch.device) -> Tensor:
        if self.site not in _SITES:
            raise ValueError(
                f"kernel fault site must be one of {sorted(_SITES)}, got {self.site!r}"
            )
        bh = self.batch * heads + self.head
        vals = [_SITES[self.site], bh, self.row, self.col, self.value, float(self.persistent)]
        return torch.tensor(vals, dtype=torch.float32, device=device)


def tolerance(dtype: torch.dtype) -> float:
    """tau of the checks (derived in ``flash_fwd``'s docstring): 1e-4 for fp16 / bf16 operands
    (exact products, fp32 accumulation), 4e-3 for fp32 operands (TF32 MMAs on a GPU)."""
    return 4e-3 if dtype == torch.float32 else 1e-4


def new_counts(device: torch.device) -> Tensor:
    """(len(CHECKS), 3) int32 device counters: detected, corrected, uncorrected."""
    return torch.zeros(len(CHECKS), 3, dtype=torch.int32, device=device)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    check: bool = True,
    fault: KernelFault | None = None,
    counts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention softmax(q k^T * scale + masks) v: (out (B, H, L, d), lse (B, H, L) in base 2
    (log2 of each row's normaliser, scaled logits), counts) with the checks of ``flash_fwd``;
    ``counts`` (from :func:`new_counts`) is added to in place."""
    B, H, L, d = q.shape
    Bk, Hkv, Lk, dk = k.shape
    if (Bk, dk) != (B, d) or v.shape != k.shape or H % Hkv:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_mask is not None and tuple(key_mask.shape) != (B, Lk):
        raise ValueError(f"key_mask must be (B, Lk) = {(B, Lk)}, got {tuple(key_mask.shape)}")
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    counts = new_counts(q.device) if counts is None else counts
    mask = (
        key_mask.to(torch.int8).contiguous()
        if key_mask is not None
        else torch.empty(1, 1, dtype=torch.int8, device=q.device)
    )
    code = (
        fault.encode(H, q.device)
        if fault is not None
        else torch.zeros(6, dtype=torch.float32, device=q.device)
    )
    block_m, block_n = _block(L, 64), _block(Lk, 64)
    grid = (triton.cdiv(L, block_m), B * H)
    _fwd[grid](
        q, k, v, out, lse, mask, counts, code,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), mask.stride(0),
        H, L, Lk, d, H // Hkv, scale * 1.4426950408889634, window, tolerance(q.dtype),
        CAUSAL=causal, WINDOW=window > 0, HAS_MASK=key_mask is not None,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, CHECK=check,
        INJECT=fault is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )  # fmt: skip
    return out, lse, counts
