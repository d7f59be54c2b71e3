"""Launching the checked flash attention kernels: shapes, launch settings, tolerances,
counters, faults.

    out, lse, counts = flash_forward(q, k, v, causal=True)

q (B, H, L, d), k and v (B, Hkv, Lk, d) with H a multiple of Hkv (GQA / MQA); ``key_mask``
(B, Lk) bool marks the keys each sequence may attend (padding); ``window`` keeps the last
``window`` keys of each query (sliding-window attention). No L x L tensor is ever allocated.
``check``: True (every check of :data:`CHECKS`), False (none) or the names of the checks to
run (``attnchecker.kernels.checks_of`` maps config ops to them); ``tolerance_scale``
multiplies every tolerance.

Launch settings (blocks, warps, pipeline stages) come from :data:`LAUNCH`, per kernel, head
size, operand width and GPU architecture, chosen from the ptxas reports of
``python -m attnchecker.kernels.aot`` (no register spills, shared memory within the target's
limit; ``benchmarks/results/kernel_ptxas_*.md``).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from attnchecker.abft.tolerance import kernel_factor, tf32_enabled
from attnchecker.errors import ConfigError
from attnchecker.kernels import CHECKS, KERNEL_SITES, interpreting
from attnchecker.kernels import flash_bwd as bwd
from attnchecker.kernels.common import FAULT_FIELDS, MODES, SITE_CODES
from attnchecker.kernels.flash_fwd import fwd_kernel

__all__ = [
    "CHECKS", "FP32_MAX_HEAD", "LAUNCH", "SITES", "KernelFault", "Launch", "flash_backward",
    "flash_forward", "launch_key", "launch_settings", "new_counts", "operand_kind",
]  # fmt: skip

SITES = SITE_CODES
"""The GEMMs a fault can hit: the forward's S and PV; in the dK/dV program S^T (recomputed),
dP^T and the dV, dK accumulators; in the dQ program S (recomputed), dP and the dQ accumulator."""
FORWARD_SITES = ("s", "pv")
assert tuple(SITES) == KERNEL_SITES

KERNEL_FLAGS = {
    "fwd": {"CHECK_S": "s", "CHECK_PV": "pv", "CHECK_SM": "softmax"},
    "dkdv": {"CHECK_ST": "st", "CHECK_DPT": "dpt", "CHECK_DV": "dv", "CHECK_DK": "dk"},
    "dq": {"CHECK_P": "p_sum", "CHECK_DS": "ds_sum", "CHECK_DQ": "dq"},
}
"""Each kernel's constexpr switch of each of its checks (:data:`CHECKS`)."""

TAU_P_LOGITS = 1e-3
"""The part of the dQ program's probability invariant (|sum_j P_ij - 1|) that is neither
rounding of the sum nor the recomputed logits' rounding (bounded per row from |q_i| and the
keys' norms, ``flash_bwd``): exp2's approximation and the forward's log-sum-exp; 1e-3 allows a
base-2 logit difference of 1e-3 in every key of a row."""


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
        if self.site not in SITES:
            raise ConfigError(f"kernel fault site must be one of {sorted(SITES)}: {self.site!r}")
        if self.mode not in MODES:
            raise ConfigError(f"kernel fault mode must be one of {sorted(MODES)}: {self.mode!r}")
        bh = self.batch * heads + self.head
        vals = [SITES[self.site], bh, self.row, self.col, self.value, float(self.persistent),
                MODES[self.mode], self.bit]  # fmt: skip
        return torch.tensor(vals, dtype=torch.float32, device=device)


def new_counts(device: torch.device) -> Tensor:
    """(len(CHECKS), 3) int32 device counters: detected, corrected, uncorrected."""
    return torch.zeros(len(CHECKS), 3, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Launch:
    """How one kernel is launched: its tile (``block_m`` query rows by ``block_n`` keys, caps:
    short sequences take the next power of two, at least 16), warps and pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _table(arch: int, kind: str, rows: dict) -> dict:
    return {(kernel, arch, block_d, kind): Launch(*go) for (kernel, block_d), go in rows.items()}


_HALF = {  # fp16 / bf16 operands on sm_90: (block_m, block_n, warps, stages), timed on an
    # H200 (benchmarks/tune_launch.py, checked, causal, bf16, B 2 x H 16 x L 4096; results/
    # launch_tuning_cuda_2026-12-04.md): the fastest of 48 (fwd) / 32 candidates without alarms
    ("fwd", 64): (128, 32, 4, 2), ("fwd", 128): (128, 64, 8, 3),
    ("dkdv", 64): (32, 64, 4, 1), ("dkdv", 128): (32, 128, 8, 2),
    ("dq", 64): (64, 32, 4, 2), ("dq", 128): (64, 32, 4, 2),
}  # fmt: skip
_HALF_80 = {  # fp16 / bf16 on sm_80 (mma.sync keeps more of the tiles in registers)
    ("fwd", 64): (32, 32, 8, 1), ("fwd", 128): (32, 32, 8, 1),
    ("dkdv", 64): (32, 32, 8, 1), ("dkdv", 128): (32, 32, 8, 1),
    ("dq", 64): (32, 32, 8, 1), ("dq", 128): (32, 32, 8, 1),
}  # fmt: skip
_TF32 = {  # fp32 operands on TF32 MMAs
    ("fwd", 64): (32, 32, 8, 1), ("fwd", 128): (32, 32, 8, 1),
    ("dkdv", 64): (16, 32, 8, 1), ("dkdv", 128): (16, 32, 8, 1),
    ("dq", 64): (32, 32, 8, 1), ("dq", 128): (32, 32, 8, 1),
}  # fmt: skip
_FP32 = {  # fp32 operands, full-precision FMA products: d <= 64 only (FP32_MAX_HEAD)
    ("fwd", 64): (32, 16, 4, 1), ("dkdv", 64): (16, 16, 4, 1), ("dq", 64): (32, 16, 4, 1),
}  # fmt: skip

LAUNCH: dict[tuple[str, int, int, str], Launch] = {
    **_table(90, "half", _HALF),
    **_table(80, "half", _HALF_80),
    **{k: v for arch in (80, 90) for k, v in _table(arch, "tf32", _TF32).items()},
    **{k: v for arch in (80, 90) for k, v in _table(arch, "fp32", _FP32).items()},
}
"""(kernel, GPU architecture (80: A100, 90: H100 / H200), BLOCK_D, operand kind: "half"
(fp16 / bf16), "tf32" or "fp32") -> its :class:`Launch`, from the ptxas reports
(``python -m attnchecker.kernels.aot``, ``benchmarks/results/kernel_ptxas_*.md``; the dK/dV
program owns ``block_n`` keys and streams ``block_m`` queries). Measured choices: 32-key tiles
(the checks keep a few fp32 tiles of the S shape live), 8 warps at d = 128, smaller tiles for
fp32."""

FP32_MAX_HEAD = 64
"""fp32 operands without TF32 multiply on the FMA units, whose operands sit in registers: at
d = 128 every tile setting spills kilobytes (sm_80 falls back to 32 registers and a 5 KB stack
frame), so the fused backend runs such calls on the eager engine (``attention.engines``)."""


def operand_kind(q: Tensor) -> str:
    """ "half", "tf32" or "fp32": how the kernels multiply ``q``'s dtype here."""
    if q.dtype != torch.float32:
        return "half"
    return "tf32" if _tf32(q) else "fp32"


def launch_settings(kernel: str, arch: int | None, block_d: int, kind: str) -> Launch:
    """The launch of ``kernel`` ("fwd", "dkdv", "dq") on ``arch`` (major * 10 + minor; None:
    the interpreter, :class:`Launch` ()'s defaults) for a padded head size ``block_d`` and an
    operand ``kind`` (:func:`operand_kind`): the table's newest architecture not above
    ``arch``, its smallest head size not below ``block_d`` (else its largest)."""
    key = launch_key(kernel, arch, block_d, kind)
    return Launch() if key is None else LAUNCH[key]


def launch_key(kernel: str, arch: int | None, block_d: int, kind: str):
    """The :data:`LAUNCH` row :func:`launch_settings` reads (None: the defaults)."""
    if arch is None:
        return None
    rows = [key for key in LAUNCH if key[0] == kernel and key[3] == kind and key[1] <= arch]
    if not rows:
        return None
    newest = max(key[1] for key in rows)
    sizes = sorted(key[2] for key in rows if key[1] == newest)
    return kernel, newest, next((b for b in sizes if b >= block_d), sizes[-1]), kind


def device_arch(device: torch.device) -> int | None:
    """The compute capability (major * 10 + minor) of a CUDA ``device``; None elsewhere."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _names(check: bool | Collection[str]) -> frozenset[str]:
    if check is True or check is False:
        return frozenset(CHECKS if check else ())
    unknown = sorted(set(check) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown kernel checks {unknown}; choose from {list(CHECKS)}")
    return frozenset(check)


def checks_to_mask(check: bool | Collection[str]) -> int:
    """The checks as the custom ops' bit mask (bit i: ``CHECKS[i]``)."""
    return sum(1 << i for i, c in enumerate(CHECKS) if c in _names(check))


def mask_to_checks(mask: int) -> frozenset[str]:
    """The checks of a bit mask (:func:`checks_to_mask`'s inverse)."""
    return frozenset(c for i, c in enumerate(CHECKS) if mask >> i & 1)


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    check: bool | Collection[str] = True,
    tolerance_scale: float = 1.0,
    fault: KernelFault | Tensor | None = None,
    counts: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention softmax(q k^T * scale + masks) v: (out (B, H, L, d), lse (B, H, L) in base 2
    (log2 of each row's normaliser, scaled logits), counts) with the checks of ``flash_fwd``;
    ``counts`` (from :func:`new_counts`) is added to in place."""
    if isinstance(fault, KernelFault) and fault.site in SITES and fault.site not in FORWARD_SITES:
        raise ValueError(f"{fault.site!r} is a backward site: give it to flash_attention")
    B, H, L, d = q.shape
    Lk = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    counts = new_counts(q.device) if counts is None else counts
    mask, code, flags = _launch(q, k, v, key_mask, fault, causal, window)
    go = _settings("fwd", q, L, Lk, check)
    tau = _tau(q, inner=d, length=go["BLOCK_M"], scale=tolerance_scale)
    tau_acc = _tau(q, inner=Lk + Lk // go["BLOCK_N"] + 1, length=d, scale=tolerance_scale)
    fwd_kernel[(triton.cdiv(L, go["BLOCK_M"]), B * H)](
        q, k, v, out, lse, mask, counts, code,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), mask.stride(0),
        H, L, Lk, d, H // k.shape[1], scale * LOG2E, window, tau, tau_acc, **flags, **go,
    )  # fmt: skip
    return out, lse, counts


LOG2E = 1.4426950408889634  # the kernels work in base 2


def _tf32(q: Tensor) -> bool:
    """Whether the kernels' fp32 GEMMs run on TF32 (as torch's fp32 matmuls would here)."""
    return q.dtype == torch.float32 and not interpreting() and tf32_enabled()


def _tau(q: Tensor, *, inner: int, length: int, scale: float) -> float:
    return scale * kernel_factor(q.dtype, inner=inner, length=length, tf32=_tf32(q))


def _settings(kernel: str, q: Tensor, L: int, Lk: int, check) -> dict:
    """The constexpr blocks, check switches and launch options of one kernel."""
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    go = launch_settings(kernel, device_arch(q.device), block_d, operand_kind(q))
    names = _names(check)
    flags = {flag: name in names for flag, name in KERNEL_FLAGS[kernel].items()}
    # BLOCK_M tiles the queries and BLOCK_N the keys in every kernel (owned or streamed)
    return dict(**flags, BLOCK_M=_block(L, go.block_m), BLOCK_N=_block(Lk, go.block_n),
                BLOCK_D=block_d, num_warps=go.num_warps, num_stages=go.num_stages)  # fmt: skip


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def _launch(q, k, v, key_mask, fault, causal: bool, window: int):
    """(int8 key mask, encoded fault, the constexpr flags every kernel takes) of one launch;
    the shapes are validated here."""
    B, H, _L, d = q.shape
    Bk, Hkv, Lk, dk = k.shape
    if (Bk, dk) != (B, d) or v.shape != k.shape or H % Hkv:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_mask is not None and tuple(key_mask.shape) != (B, Lk):
        raise ValueError(f"key_mask must be (B, Lk) = {(B, Lk)}, got {tuple(key_mask.shape)}")
    if B * H > 65535:  # the (batch, head) programs are the grid's second axis
        raise ValueError(f"batch * heads = {B * H} is over the 65,535 the kernels launch")
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
        UPCAST=interpreting() and q.dtype == torch.bfloat16, INJECT=fault is not None,
        DOT="ieee" if operand_kind(q) == "fp32" else "tf32",
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
    check: bool | Collection[str] = True,
    tolerance_scale: float = 1.0,
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
    lse = lse.contiguous()  # the kernels index it as (B, H, L) contiguous (a no-op as saved)
    prod = grad.float() * out.float()
    delta = prod.sum(-1).contiguous()  # (B, H, L): sum_j P dP of each row
    delta_abs = prod.abs_().sum(-1).contiguous()
    # each gradient as the custom op's fake has it, empty_like its input: the input's layout
    # where that is dense, else contiguous; never the input's own strides, which may overlap
    # (K / V expanded over heads, stride 0: every head's program wrote the one row, dK off by
    # more than its size) or leave gaps (a slice of a fused Q|K|V projection). The kernels
    # read the inputs with their strides and write the gradients with the gradients'.
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    mask, code, flags = _launch(q, k, v, key_mask, fault, causal, window)
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad.stride(), mask.stride(0))
    qk_scale, group, tol = scale * LOG2E, H // Hkv, tolerance_scale
    go = _settings("dkdv", q, L, Lk, check)
    tau = _tau(q, inner=d, length=go["BLOCK_N"], scale=tol)
    tau_acc = _tau(q, inner=group * L, length=d, scale=tol)
    bwd.dkdv_kernel[(triton.cdiv(Lk, go["BLOCK_N"]), B * Hkv)](
        q, k, v, grad, lse, delta, dk, dv, mask, counts, code, *strides,
        *dk.stride(), *dv.stride(), H, Hkv, L, Lk, d, group, qk_scale, scale, window, tau,
        tau_acc, **flags, **go,
    )  # fmt: skip
    go = _settings("dq", q, L, Lk, check)
    tau_acc = _tau(q, inner=Lk, length=d, scale=tol)
    tau_p = tol * (TAU_P_LOGITS + kernel_factor(q.dtype, inner=Lk, length=Lk, tf32=_tf32(q)))
    tau_logit = tol * 2 * math.log(2) * qk_scale * _tau(q, inner=d, length=0, scale=1.0)
    tau_out = tol * 2 * torch.finfo(out.dtype).eps
    q_norm, k_norm = (t.float().norm(dim=-1).contiguous() for t in (q, k))  # (B, H|Hkv, L)
    bwd.dq_kernel[(triton.cdiv(L, go["BLOCK_M"]), B * H)](
        q, k, v, grad, lse, delta, delta_abs, q_norm, k_norm, dq, mask, counts, code, *strides,
        *dq.stride(), H, L, Lk, d, group, qk_scale, scale, window, tau_acc, tau_p, tau_logit,
        tau_out, **flags, **go,
    )  # fmt: skip
    return dq, dk, dv
