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

from attnchecker.kernels import KERNEL_SITES, interpreting
from attnchecker.kernels import flash_bwd as bwd
from attnchecker.kernels.common import FAULT_FIELDS, MODES
from attnchecker.kernels.flash_fwd import SITE_PV, SITE_S, _fwd

__all__ = [
    "CHECKS", "SITES", "KernelFault", "flash_attention", "flash_backward", "flash_forward",
    "new_counts", "tolerance",
]  # fmt: skip

CHECKS = ("s", "pv", "softmax", "st", "dpt", "dv", "dk", "p_sum", "ds_sum", "dq")
"""Rows of the counters (columns: detected, corrected, uncorrected). Forward: the S tile
check, the deferred PV check, the softmax range check; backward dK/dV program: the S^T and dP^T
tile checks, the deferred dV and dK checks; dQ program: the invariants sum_j P = 1 and
sum_j dS = 0, the deferred dQ check."""

SITES = {"s": SITE_S, "pv": SITE_PV, "st": bwd.SITE_ST, "dpt": bwd.SITE_DPT, "dv": bwd.SITE_DV,
         "dk": bwd.SITE_DK, "sq": bwd.SITE_SQ, "dp": bwd.SITE_DP, "dq": bwd.SITE_DQ}  # fmt: skip
"""The GEMMs a fault can hit: the forward's S and PV; in the dK/dV program S^T (recomputed),
dP^T and the dV, dK accumulators; in the dQ program S (recomputed), dP and the dQ accumulator."""
_SITES = SITES
FORWARD_SITES = ("s", "pv")
assert tuple(SITES) == KERNEL_SITES


@dataclass(frozen=True)
class KernelFault:
    """One fault inside a kernel GEMM (:data:`SITES`) of (``batch``, ``head``): for S-like
    tiles (s, st, sq, dp, dpt) at query ``row``, key ``col``; for accumulators (pv, dq) at
    query ``row``, feature ``col``, and (dv, dk) at key ``row``, feature ``col``, after the
    first tile. A transient fault hits the first computation; a ``persistent`` one every
    recomputation too."""

    site: str
    batch: int
    head: int
    row: int  # -1: every row (a column fault)
    col: int  # -1: every column (a row fault)
    value: float = 0.0
    persistent: bool = False
    mode: str = "set"  # set to value, scale by it, flip ``bit``, or the reference "exponent" flip
    bit: int = 0

    def encode(self, heads: int, device: torch.device) -> Tensor:
        """The (len(FAULT_FIELDS),) float32 vector the kernels read."""
        if self.site not in _SITES:
            raise ValueError(f"kernel fault site must be one of {sorted(_SITES)}: {self.site!r}")
        if self.mode not in MODES:
            raise ValueError(f"kernel fault mode must be one of {sorted(MODES)}: {self.mode!r}")
        bh = self.batch * heads + self.head
        vals = [_SITES[self.site], bh, self.row, self.col, self.value, float(self.persistent),
                MODES[self.mode], self.bit]  # fmt: skip
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
    fault: KernelFault | Tensor | None = None,
    counts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention softmax(q k^T * scale + masks) v: (out (B, H, L, d), lse (B, H, L) in base 2
    (log2 of each row's normaliser, scaled logits), counts) with the checks of ``flash_fwd``;
    ``counts`` (from :func:`new_counts`) is added to in place."""
    if isinstance(fault, KernelFault) and fault.site in SITES and fault.site not in FORWARD_SITES:
        raise ValueError(f"{fault.site!r} is a backward site: give it to flash_attention")
    B, H, L, d = q.shape
    Hkv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    counts = new_counts(q.device) if counts is None else counts
    mask, code, flags = _launch(q, k, v, key_mask, fault, causal, window, check)
    _fwd[(triton.cdiv(L, flags["BLOCK_M"]), B * H)](
        q, k, v, out, lse, mask, counts, code,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), mask.stride(0),
        H, L, k.shape[2], d, H // Hkv, scale * LOG2E, window, tolerance(q.dtype), **flags,
    )  # fmt: skip
    return out, lse, counts


LOG2E = 1.4426950408889634  # the kernels work in base 2


def _launch(q, k, v, key_mask, fault, causal: bool, window: int, check: bool):
    """(int8 key mask, encoded fault, the kernels' constexpr flags) of one launch; the shapes
    are validated here."""
    B, H, L, d = q.shape
    Bk, Hkv, Lk, dk = k.shape
    if (Bk, dk) != (B, d) or v.shape != k.shape or H % Hkv:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_mask is not None and tuple(key_mask.shape) != (B, Lk):
        raise ValueError(f"key_mask must be (B, Lk) = {(B, Lk)}, got {tuple(key_mask.shape)}")
    device = q.device
    mask = (
        key_mask.to(torch.int8).contiguous()
        if key_mask is not None
        else torch.empty(1, 1, dtype=torch.int8, device=device)
    )
    if isinstance(fault, KernelFault):
        code = fault.encode(H, device)
    elif fault is not None:  # already encoded (the custom ops pass tensors)
        code = fault
    else:
        code = torch.zeros(len(FAULT_FIELDS), dtype=torch.float32, device=device)
    flags = dict(
        CAUSAL=causal, WINDOW=window > 0, HAS_MASK=key_mask is not None,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, CHECK=check,
        INJECT=fault is not None, BLOCK_M=_block(L, 64), BLOCK_N=_block(Lk, 64),
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )  # fmt: skip
    return mask, code, flags


def flash_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    check: bool = True,
    fault: KernelFault | Tensor | None = None,
    counts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`flash_forward`'s attention for the output gradient ``grad``, from
    the saved q, k, v, out and lse (P is recomputed), with the checks of ``flash_bwd``."""
    B, H, L, d = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if isinstance(fault, KernelFault) and fault.site in FORWARD_SITES:
        raise ValueError(f"{fault.site!r} is a forward site: give it to flash_forward")
    scale = d**-0.5 if scale is None else scale
    counts = new_counts(q.device) if counts is None else counts
    grad = grad.contiguous()  # autograd may hand an expanded (stride 0) gradient
    prod = grad.float() * out.float()
    delta = prod.sum(-1).contiguous()  # (B, H, L): sum_j P dP of each row
    delta_abs = prod.abs_().sum(-1).contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device)
    dv = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    mask, code, flags = _launch(q, k, v, key_mask, fault, causal, window, check)
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad.stride(), mask.stride(0))
    qk_scale, tau = scale * LOG2E, tolerance(q.dtype)
    bwd._bwd_dkdv[(triton.cdiv(Lk, flags["BLOCK_N"]), B * Hkv)](
        q, k, v, grad, lse, delta, dk, dv, mask, counts, code, *strides,
        H, Hkv, L, Lk, d, H // Hkv, qk_scale, scale, window, tau, **flags,
    )  # fmt: skip
    tau_out = 2 * torch.finfo(out.dtype).eps
    bwd._bwd_dq[(triton.cdiv(L, flags["BLOCK_M"]), B * H)](
        q, k, v, grad, lse, delta, delta_abs, dq, mask, counts, code, *strides,
        H, L, Lk, d, H // Hkv, qk_scale, scale, window, tau, tau_out, **flags,
    )  # fmt: skip
    return dq, dk, dv


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    counts: Tensor | None = None,
    sink: Tensor | None = None,
    fault: KernelFault | None = None,
    check: bool = True,
) -> Tensor:
    """Differentiable checked flash attention (the custom ops of :mod:`attnchecker.kernels.ops`,
    so torch.compile traces one op): the forward's detections are added to ``counts``
    (:func:`new_counts`), the backward's accumulate in ``sink.grad`` (``ops.new_sink``). A
    ``fault`` at a backward site is injected in the backward, at a forward site in the
    forward. ``check=False`` runs the kernels without their checks (an unprotected arm)."""
    from attnchecker.kernels.ops import flash_fwd_op, new_sink

    code_f = code_b = None
    if fault is not None:
        code = fault.encode(q.shape[1], q.device)
        code_f, code_b = (code, None) if fault.site in FORWARD_SITES else (None, code)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sink = new_sink(q.device) if sink is None else sink
    out, _, found = flash_fwd_op(
        q, k, v, key_mask, sink, code_f, code_b, causal, window, scale, check
    )
    if counts is not None:
        counts.add_(found)
    return out
