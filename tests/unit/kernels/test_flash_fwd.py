"""The checked flash attention forward (Triton; the interpreter on CPU): equal to SDPA over the
options real models use, faults in its GEMMs corrected (transient) or reported (persistent),
no false alarm over scales, masks and dtypes, and no L x L tensor.

Tolerances against SDPA computed in fp32 from the same operands: fp32 1e-5 (different
summation orders), fp16 2e-3 and bf16 2e-2 (the output and the probabilities entering the PV
MMA are rounded to the operand dtype, as flash attention does).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from attnchecker.kernels import available
from attnchecker.kernels.flash import CHECKS, KernelFault, flash_forward

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ATOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}


def _operands(B, H, Hkv, L, Lk, d, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        (scale * torch.randn(B, n, m, d, generator=g)).to(DEVICE, DTYPES[dtype])
        for n, m in ((H, L), (Hkv, Lk), (Hkv, Lk))
    )
    return q, k, v


def _allowed(B, L, Lk, *, causal, window, key_mask):
    """(B, 1, L, Lk) bool: which keys each query may attend (query i sits at Lk - L + i)."""
    i = torch.arange(L)[:, None] + (Lk - L)
    j = torch.arange(Lk)[None, :]
    ok = torch.ones(L, Lk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    ok = ok.expand(B, 1, L, Lk).to(DEVICE)
    if key_mask is not None:
        ok = ok & key_mask[:, None, None, :]
    return ok


def _reference(q, k, v, allowed):
    rep = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(rep, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=allowed)
    return out, allowed.any(-1, keepdim=True)  # rows with no key: SDPA gives NaN, the kernel 0


CASES = {  # name: (B, H, Hkv, L, Lk, d, causal, window, padding)
    "bidirectional": (2, 4, 4, 64, 64, 64, False, 0, False),
    "causal_ragged": (2, 4, 4, 100, 100, 64, True, 0, False),
    "padding": (2, 2, 2, 80, 80, 64, False, 0, True),
    "causal_padding": (2, 2, 2, 48, 48, 64, True, 0, True),
    "gqa": (1, 4, 2, 72, 72, 64, True, 0, False),
    "mqa": (1, 4, 1, 40, 40, 64, False, 0, False),
    "window": (1, 2, 2, 130, 130, 64, True, 24, False),
    "kv_cache": (2, 2, 2, 5, 90, 64, True, 0, False),  # decoding: 5 new queries, 90 keys
    "d128": (1, 2, 2, 48, 48, 128, True, 0, False),
    "d8": (2, 4, 2, 16, 16, 8, True, 0, False),  # the tiny test models' head size
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_equals_sdpa(case, dtype):
    B, H, Hkv, L, Lk, d, causal, window, padding = CASES[case]
    q, k, v = _operands(B, H, Hkv, L, Lk, d, dtype)
    key_mask = None
    if padding:
        key_mask = torch.ones(B, Lk, dtype=torch.bool, device=DEVICE)
        key_mask[1, Lk - 13 :] = False
    out, lse, counts = flash_forward(q, k, v, causal=causal, window=window, key_mask=key_mask)
    want, rows = _reference(q, k, v, _allowed(B, L, Lk, causal=causal, window=window,
                                              key_mask=key_mask))  # fmt: skip
    err = torch.where(rows, (out.float() - want).abs(), 0).max()
    assert err <= ATOL[dtype], err
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert counts.sum() == 0, counts.tolist()  # and no false alarm


KINDS = {  # name: (mode, value) of the kernel fault (kernels.common)
    "inf": ("set", math.inf), "-inf": ("set", -math.inf), "nan": ("set", math.nan),
    "near_inf": ("set", 1e10), "exponent_flip": ("exponent", 0.0),
    "random_large": ("set", 7.3e6), "large_negative": ("set", -3e4),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's inf - inf
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("site", ["s", "pv"])
def test_faults_are_corrected_or_reported(site, kind, persistent):
    q, k, v = _operands(2, 2, 2, 70, 70, 64, "fp32", seed=3)
    want, _, clean = flash_forward(q, k, v, causal=True)
    mode, value = KINDS[kind]
    fault = KernelFault(site, batch=1, head=1, row=40, col=(7 if site == "s" else 11),
                        value=value, persistent=persistent, mode=mode)  # fmt: skip
    out, _, counts = flash_forward(q, k, v, causal=True, fault=fault)
    row = CHECKS.index(site)
    assert clean.sum() == 0
    assert counts[row, 0] >= 1, counts.tolist()  # detected by its own check
    if persistent:
        assert counts[:, 2].sum() >= 1, counts.tolist()  # reported uncorrected
    else:
        assert counts[row].tolist() == [1, 1, 0], counts.tolist()
        assert counts[:, 2].sum() == 0
        assert torch.equal(out, want)  # the recomputation is the fault-free result


def test_a_fault_in_a_masked_position_is_harmless_and_still_seen():
    """S[row, col] beyond the causal diagonal never reaches the output, yet the S check sees the
    tile's row sum change: detected, recomputed, output unchanged. Key 5 of query 3 is in the
    first key tile, which the first query tile computes whatever the launch's tile sizes (16
    at least); a key past the query tile's last row is never computed (col=50 was, with the
    interpreter's 64-row tiles, but not with an H200's 32)."""
    q, k, v = _operands(1, 1, 1, 64, 64, 64, "fp32", seed=4)
    want, _, _ = flash_forward(q, k, v, causal=True)
    out, _, counts = flash_forward(
        q, k, v, causal=True, fault=KernelFault("s", 0, 0, row=3, col=5, value=math.nan)
    )
    assert counts[0].tolist() == [1, 1, 0] and torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_false_alarm_over_scales_and_masks(dtype):
    """Input scales 0.1 .. 100 (logits up to ~6e5), causal / bidirectional, padding, window:
    no check fires."""
    total = torch.zeros(len(CHECKS), 3, dtype=torch.int32, device=DEVICE)
    cases = 0
    for seed, scale in enumerate((0.1, 1.0, 10.0, 100.0)):
        for causal, window, padding in ((False, 0, True), (True, 0, False), (True, 16, True)):
            q, k, v = _operands(1, 2, 1, 50, 50, 64, dtype, scale=scale, seed=seed)
            key_mask = None
            if padding:
                g = torch.Generator().manual_seed(seed)
                key_mask = (torch.rand(1, 50, generator=g) > 0.3).to(DEVICE)
            flash_forward(q, k, v, causal=causal, window=window, key_mask=key_mask, counts=total)
            cases += 1
    assert cases == 12 and total.sum() == 0, total.tolist()


def test_no_attention_sized_tensor_is_allocated():
    """Memory like flash attention: the launcher (and the interpreter's copies of the operands)
    allocate the output, the log-sum-exp and small vectors, never an L x Lk tensor (the kernel
    keeps its tiles on chip)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):  # bytes (the interpreter copies raw storages)
                    self.largest = max(self.largest, t.numel() * t.element_size())
            return out

    L = 256
    q, k, v = _operands(1, 1, 1, L, L, 16, "fp32")
    with Sizes() as sizes:
        flash_forward(q, k, v, causal=True)
    assert sizes.largest <= L * 16 * 4 < L * L * 4  # an input or the output (L x d fp32)


def test_bad_shapes_are_refused():
    q, k, v = _operands(1, 3, 2, 8, 8, 16, "fp32")
    with pytest.raises(ValueError, match="shapes"):
        flash_forward(q, k, v)
    q, k, v = _operands(1, 2, 2, 8, 8, 16, "fp32")
    with pytest.raises(ValueError, match="key_mask"):
        flash_forward(q, k, v, key_mask=torch.ones(1, 9, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="backward site"):
        flash_forward(q, k, v, fault=KernelFault("dq", 0, 0, 0, 0, 1.0))
    with pytest.raises(ValueError, match="site must be one of"):
        flash_forward(q, k, v, fault=KernelFault("qk", 0, 0, 0, 0, 1.0))
    with pytest.raises(ValueError, match="unknown kernel checks"):
        flash_forward(q, k, v, check={"scores"})  # a config op, not a kernel check


def test_each_check_is_switched_on_its_own():
    """A fault in S is seen by the S check alone: with only the PV and softmax checks on (their
    references come from the corrupted S), nothing is detected; with the S check, it is."""
    q, k, v = _operands(1, 2, 2, 70, 70, 64, "fp32", seed=5)
    fault = KernelFault("s", 0, 1, row=40, col=7, value=100.0)
    _, _, counts = flash_forward(q, k, v, causal=True, fault=fault, check={"pv", "softmax"})
    assert counts.sum() == 0, counts.tolist()
    _, _, counts = flash_forward(q, k, v, causal=True, fault=fault, check={"s"})
    assert counts[CHECKS.index("s")].tolist() == [1, 1, 0], counts.tolist()


def test_tolerance_scale_reaches_the_kernels():
    """S[40, 7] = 100 (logits of ~8) is ~4% of its column's bound: far past the derived tau
    (~3e-5), inside it at tolerance_scale 1e4."""
    q, k, v = _operands(1, 2, 2, 70, 70, 64, "fp32", seed=5)
    fault = KernelFault("s", 0, 1, row=40, col=7, value=100.0)
    _, _, counts = flash_forward(q, k, v, causal=True, fault=fault, check={"s"})
    assert counts[CHECKS.index("s"), 0] == 1
    _, _, counts = flash_forward(q, k, v, causal=True, fault=fault, check={"s"},
                                 tolerance_scale=1e4)  # fmt: skip
    assert counts.sum() == 0, counts.tolist()
