"""Largest errors of the checked flash kernels against SDPA (an fp32 reference from the same
operands) over the layouts of ``tests/unit/kernels``, per dtype: the figures the tests bound.

    python scripts/flash_equivalence.py     (from the repository root; CPU: the interpreter)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.unit.kernels import test_flash_bwd as bwd
from tests.unit.kernels import test_flash_fwd as fwd
from torch.nn import functional as F

from attnchecker.kernels.flash import flash_forward


def _mask(B: int, Lk: int, padding: bool, cut: int) -> torch.Tensor | None:
    if not padding:
        return None
    mask = torch.ones(B, Lk, dtype=torch.bool, device=fwd.DEVICE)
    mask[1, Lk - cut :] = False
    return mask


def main() -> None:
    for dtype in fwd.DTYPES:
        out_err = 0.0
        for B, H, Hkv, L, Lk, d, causal, window, padding in fwd.CASES.values():
            q, k, v = fwd._operands(B, H, Hkv, L, Lk, d, dtype)
            mask = _mask(B, Lk, padding, 13)
            out, _, _ = flash_forward(q, k, v, causal=causal, window=window, key_mask=mask)
            allowed = fwd._allowed(B, L, Lk, causal=causal, window=window, key_mask=mask)
            want, rows = fwd._reference(q, k, v, allowed)
            out_err = max(out_err, float(torch.where(rows, (out.float() - want).abs(), 0).max()))
        grad_err = dict.fromkeys(("dq", "dk", "dv"), 0.0)
        for B, H, Hkv, L, Lk, d, causal, window, padding in bwd.CASES.values():
            q, k, v = fwd._operands(B, H, Hkv, L, Lk, d, dtype, seed=1)
            grad = torch.randn(B, H, L, d, generator=torch.Generator().manual_seed(2)).to(q)
            mask = _mask(B, Lk, padding, 9)
            got, _ = bwd._grads(q, k, v, grad, causal=causal, window=window, key_mask=mask)
            rep = H // Hkv
            q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
            allowed = fwd._allowed(B, L, Lk, causal=causal, window=window, key_mask=mask)
            ref = F.scaled_dot_product_attention(
                q2, k2.repeat_interleave(rep, 1), v2.repeat_interleave(rep, 1), attn_mask=allowed
            )
            ref.backward(grad.float())
            for name, a, b in zip(grad_err, got[1:], (q2.grad, k2.grad, v2.grad), strict=True):
                rel = float((a.float() - b).abs().max()) / max(1.0, float(b.abs().max()))
                grad_err[name] = max(grad_err[name], rel)
        grads = ", ".join(f"{n} {e:.1e}" for n, e in grad_err.items())
        print(f"{dtype}: O max abs error {out_err:.1e}; gradients (relative to max(1, |ref|)) "
              f"{grads}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
