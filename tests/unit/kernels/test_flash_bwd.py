"""The checked flash attention backward (Triton; the interpreter on CPU): gradients equal to
SDPA's over the options real models use, a fault in any backward GEMM corrected (transient,
gradients bitwise those of the fault-free run) or reported (persistent), no false alarm.

Tolerances against SDPA's gradients computed in fp32 from the same operands: fp32 1e-5, fp16
5e-3 and bf16 5e-2 (P and dS enter their MMAs rounded to the operand dtype, as in flash
attention, and the gradients are stored in it).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from attnchecker.kernels import available
from attnchecker.kernels.flash import CHECKS, KernelFault, flash_backward, flash_forward, new_counts
from attnchecker.kernels.ops import flash_attention, new_sink

from .test_flash_fwd import DEVICE, DTYPES, KINDS, _allowed, _operands

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")

ATOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 5e-2}
CASES = {  # name: (B, H, Hkv, L, Lk, d, causal, window, padding)
    "bidirectional_padding": (2, 2, 2, 70, 70, 64, False, 0, True),
    "causal_gqa_ragged": (1, 4, 2, 90, 90, 64, True, 0, False),
    "window_mqa": (1, 2, 1, 100, 100, 64, True, 20, False),
    "d128": (1, 2, 2, 40, 40, 128, True, 0, False),
    "d8": (2, 4, 2, 16, 16, 8, True, 0, False),
}


def _grads(q, k, v, grad, **kw):
    """(out, dq, dk, dv) and the counters of the forward and the backward, added."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    counts, sink = new_counts(q.device), new_sink(q.device)
    out = flash_attention(q, k, v, counts=counts, sink=sink, **kw)
    out.backward(grad)
    return (out.detach(), q.grad, k.grad, v.grad), counts + sink.grad.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_sdpa(case, dtype):
    B, H, Hkv, L, Lk, d, causal, window, padding = CASES[case]
    q, k, v = _operands(B, H, Hkv, L, Lk, d, dtype, seed=1)
    grad = torch.randn(B, H, L, d, generator=torch.Generator().manual_seed(2)).to(q)
    key_mask = None
    if padding:
        key_mask = torch.ones(B, Lk, dtype=torch.bool, device=DEVICE)
        key_mask[1, Lk - 9 :] = False
    got, counts = _grads(q, k, v, grad, causal=causal, window=window, key_mask=key_mask)
    assert counts.sum() == 0, counts.tolist()  # no false alarm
    rep = H // Hkv
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    allowed = _allowed(B, L, Lk, causal=causal, window=window, key_mask=key_mask)
    out = F.scaled_dot_product_attention(
        q2, k2.repeat_interleave(rep, 1), v2.repeat_interleave(rep, 1), attn_mask=allowed
    )
    out.backward(grad.float())
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], (q2.grad, k2.grad, v2.grad), strict=True):
        err = (a.float() - b).abs().max()
        assert err <= ATOL[dtype] * max(1.0, float(b.abs().max())), (name, float(err))


BACKWARD_SITES = ("st", "dpt", "dv", "dk", "sq", "dp", "dq")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's inf - inf
@pytest.mark.parametrize(
    ("kind", "persistent"),
    [(k, False) for k in KINDS] + [(k, True) for k in ("inf", "nan", "exponent_flip")],
)  # every kind transient; persistence is one code path: three kinds
@pytest.mark.parametrize("site", BACKWARD_SITES)
def test_backward_faults_are_corrected_or_reported(site, kind, persistent):
    q, k, v = _operands(1, 2, 1, 48, 48, 64, "fp32", seed=5)
    grad = torch.randn(1, 2, 48, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want, clean = _grads(q, k, v, grad, causal=True)
    row, col = {"dv": (5, 11), "dk": (5, 11), "dq": (30, 11)}.get(site, (30, 7))
    mode, value = KINDS[kind]
    fault = KernelFault(site, 0, 1, row, col, value, persistent, mode)
    got, counts = _grads(q, k, v, grad, causal=True, fault=fault)
    assert clean.sum() == 0
    assert counts[:, 0].sum() >= 1, counts.tolist()
    if persistent:
        assert counts[:, 2].sum() >= 1, counts.tolist()
    else:
        assert counts[:, 2].sum() == 0 and counts[:, 1].sum() == counts[:, 0].sum()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if site in ("st", "dpt", "dv", "dk", "dq"):  # each guarded by its own check
        assert counts[CHECKS.index(site), 0] >= 1, counts.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_false_alarm_in_the_backward(dtype):
    total, sink = new_counts(torch.device(DEVICE)), new_sink(torch.device(DEVICE))
    for seed, scale in enumerate((0.1, 1.0, 10.0, 100.0)):
        for causal, padding in ((False, True), (True, False)):
            q, k, v = _operands(1, 2, 1, 40, 40, 64, dtype, scale=scale, seed=seed)
            key_mask = None
            if padding:
                g = torch.Generator().manual_seed(seed)
                key_mask = (torch.rand(1, 40, generator=g) > 0.3).to(DEVICE)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = flash_attention(
                q, k, v, causal=causal, key_mask=key_mask, counts=total, sink=sink
            )
            out.backward(torch.randn_like(out))
    assert total.sum() == 0 and sink.grad.sum() == 0, (total.tolist(), sink.grad.tolist())


@pytest.mark.parametrize("scale", [1.0, 10.0, 100.0])
def test_the_probability_invariant_allows_logits_rounded_otherwise_by_the_forward(scale):
    """A GPU's forward and backward compute S with other tile shapes, so the recomputed logits
    round differently from those behind the forward's log-sum-exp (the H200 saw sum_j P_ij off
    1 by more than the fixed 1e-3 at input scale 100). Here the forward's LSE comes from S in
    float64 (0.01 off in base 2 at scale 100): no check may alarm (the old bound had 2)."""
    q, k, v = _operands(1, 2, 1, 40, 40, 64, "fp32", scale=scale, seed=7)
    out, lse, _ = flash_forward(q, k, v, causal=True)
    logits = (q.double() @ k.double().transpose(-1, -2)) * 64**-0.5  # natural units
    allowed = torch.ones(40, 40, dtype=torch.bool, device=DEVICE).tril()
    lse64 = torch.logsumexp(logits.masked_fill(~allowed, -torch.inf), -1) / math.log(2)
    assert (lse64.float() - lse).abs().max() > 0  # another rounding, as another GPU tiling
    counts = new_counts(q.device)
    flash_backward(q, k, v, out, lse64.float().contiguous(), torch.randn_like(out),
                   causal=True, counts=counts)  # fmt: skip
    assert counts.sum() == 0, dict(zip(CHECKS, counts.tolist(), strict=True))


def test_slices_of_a_fused_projection_get_their_gradients_in_bounds():
    """q, k, v as GPT-2 and nanoGPT make them: slices of one fused Q|K|V output, viewed per
    head (strides with gaps). The dQ kernel writes with q's strides; its buffer was empty_like(q)
    (contiguous), which it overran (wrong gradients, or a crash freeing the heap). Now the
    fused output's gradient equals SDPA's."""
    B, H, L, d = 2, 2, 40, 16
    g = torch.Generator().manual_seed(3)
    base = torch.randn(B, L, 3 * H * d, generator=g).to(DEVICE)
    grad = torch.randn(B, H, L, d, generator=g).to(DEVICE)

    def fused_grad(attention) -> torch.Tensor:
        fused = base.clone().requires_grad_()
        q, k, v = (t.view(B, L, H, d).transpose(1, 2) for t in fused.split(H * d, dim=-1))
        assert q.stride(2) == 3 * H * d  # gaps between rows: not dense
        attention(q, k, v).backward(grad)
        return fused.grad

    got = fused_grad(lambda q, k, v: flash_attention(q, k, v, causal=True))
    want = fused_grad(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_operands_of_mixed_dtypes_are_taken_as_sdpa_takes_them():
    """Llama's RoPE under bf16 autocast leaves q and k in fp32 and v in bf16; SDPA (on autocast's
    low-precision list) casts them all to bf16, and so must the kernels: the backward's dP^T
    multiplied bf16 V by an fp32 output gradient and did not compile (H200, 2026-12-04). Under
    autocast the result equals the kernels on bf16 operands bitwise; without autocast mixed
    dtypes are an error, as in SDPA."""
    q, k, v = _operands(1, 2, 2, 32, 32, 16, "fp32")
    grad = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(1))
    grad = grad.to(DEVICE, torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got, found = _grads(q, k, v.bfloat16(), grad, causal=True)
    want, _ = _grads(q.bfloat16(), k.bfloat16(), v.bfloat16(), grad, causal=True)
    assert got[0].dtype == torch.bfloat16
    for a, b in zip(got, want, strict=True):  # dq and dk: fp32, as autocast's cast returns them
        assert torch.equal(a.to(b.dtype), b)
    assert int(found.sum()) == 0
    with pytest.raises(ValueError, match="share one dtype"):
        flash_attention(q, k, v.bfloat16())
