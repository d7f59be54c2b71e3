"""Fused attention kernels with checksums inside (Triton), for the ``backend="triton"`` path.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set
before this package is imported: the kernels are decorated at import), which computes through
numpy: slow, for tests only, and unable to compute in bf16, so bf16 operands are upcast to fp32
there (``interpreting()``).
"""

from __future__ import annotations

import os

__all__ = ["CHECKS", "DEAD", "KERNEL_CHECKS", "KERNEL_SITES", "SDPA_BLOCKS", "available",
           "checks_of", "interpreting", "self_test"]  # fmt: skip

KERNEL_CHECKS: dict[str, tuple[str, ...]] = {
    "s": ("scores",),  # forward: the S tile (column checksums)
    "pv": ("context",),  # forward: the deferred P V accumulator check
    "softmax": ("probs",),  # forward: 1 <= l_i <= valid keys
    "st": ("dk", "dv"),  # dK/dV program: the recomputed S^T, behind P^T (dV) and dS^T (dK)
    "dpt": ("dp",),  # dK/dV program: the dP^T tile
    "dv": ("dv",),  # dK/dV program: the deferred dV accumulator check
    "dk": ("dk",),  # dK/dV program: the deferred dK accumulator check
    "p_sum": ("dq",),  # dQ program: sum_j P_ij = 1 of the recomputed P, behind dS (dQ)
    "ds_sum": ("dp",),  # dQ program: sum_j dS_ij = 0, behind dP and the Delta pre-pass
    "dq": ("dq",),  # dQ program: the deferred dQ accumulator check
}
"""Each check inside the fused kernels and the ops of :class:`~attnchecker.ABFTConfig` that
switch it on (any of them): the kernels' checks are ops of the config's vocabulary, so
``ops=OPS`` (forward only) runs no backward kernel check. The order is the counters' rows."""

CHECKS = tuple(KERNEL_CHECKS)
"""Rows of the kernels' counters (columns: detected, corrected, uncorrected)."""


def checks_of(ops) -> frozenset[str]:
    """The kernel checks that a set of config ops switches on."""
    ops = set(ops)
    return frozenset(c for c, need in KERNEL_CHECKS.items() if ops.intersection(need))


SDPA_BLOCKS = (512, 32, 32)
"""The SDPA route's kernels (:mod:`~attnchecker.kernels.sdpa_kernels`): keys per stats program,
query rows and key rows per block; the scratch sizes follow from them (the ops' fake
implementations too, where nothing imports triton)."""

DEAD = -1e30
"""A query row whose mask's largest value is at or below this (finfo.min, -inf, all False)
attends no key: the backends each define its output their own way, so no SDPA-route check reads
it."""

KERNEL_SITES = ("s", "pv", "st", "dpt", "dv", "dk", "sq", "dp", "dq")
"""The GEMMs of the fused kernels a fault can hit (``kernels.flash.SITES``; named here, where
nothing imports triton, so fault plans validate without it)."""


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Whether the kernels can run here: triton importable, and CUDA or the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    import torch

    return interpreting() or torch.cuda.is_available()


_SELF_TESTS: dict[str, str | None] = {}


def self_test(device) -> str | None:
    """Run the checked kernels once on ``device`` (a small causal GQA case, forward and
    backward, bf16 on CUDA) against SDPA: None when they compile, agree and raise no alarm,
    else why not. Cached per device; ``backend="auto"`` uses the kernels only where it passes,
    so a Triton or driver the kernels were not built against costs a warning, not a crash."""
    import torch

    key = str(device)
    if key in _SELF_TESTS:
        return _SELF_TESTS[key]
    reason = None
    try:
        from torch.nn import functional as F

        from attnchecker.kernels.flash import new_counts
        from attnchecker.kernels.ops import flash_attention

        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, 80, 64, generator=g).to(device, dtype).requires_grad_()
                   for n in (4, 2, 2))  # fmt: skip
        counts = new_counts(q.device)
        out = flash_attention(q, k, v, causal=True, counts=counts)
        out.float().sum().backward()
        q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
        want = F.scaled_dot_product_attention(
            q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), is_causal=True
        )
        want.sum().backward()
        errors = [(out.float() - want).abs().max()] + [
            (a.grad.float() - b.grad).abs().max() for a, b in ((q, q2), (k, k2), (v, v2))
        ]
        if max(float(e) for e in errors) > (5e-2 if dtype == torch.bfloat16 else 1e-4):
            reason = f"results differ from SDPA by {max(float(e) for e in errors):.2e}"
        elif int(counts.sum()):
            reason = f"false alarms on clean data: {counts.tolist()}"
    except Exception as exc:  # compile errors, missing drivers: the reason is the answer
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _SELF_TESTS[key] = reason
    return reason
