"""The SDPA route's checks (``attnchecker.kernels.sdpa_check``): the backend's kernel returns
what SDPA returns, clean inputs raise no flag (fp32, bf16, fp16; outlier features, GQA, masks
with rows that attend nothing), each check flags its error class, and a repair restores the
flagged heads (or reports them lost when the operands imply the error)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from attnchecker.kernels.sdpa_backend import attention_backward, attention_forward
from attnchecker.kernels.sdpa_check import (
    bwd_repair,
    bwd_verify,
    fwd_repair,
    fwd_verify,
    kv_stats,
    mask_facts,
)

B, H, HKV, L, D = 2, 4, 2, 48, 16
SCALE = D**-0.5
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _operands(dtype=torch.float32, outliers=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, HKV, HKV))
    q[..., :2] *= outliers  # outlier features, as LLM activations have
    k[..., :2] *= outliers
    return tuple(t.to(dtype) for t in (q, k, v))


def _mask(kind: str):
    """A 4-D SDPA mask: ``bool`` with a dead query row (sample 1, row 3) and key padding,
    ``float``: an additive one (finfo.min where excluded, a small bias elsewhere)."""
    keep = torch.ones(B, 1, L, L, dtype=torch.bool).tril()
    keep[1, :, :, :5] = False  # left padding of sample 1: its rows 0-4 attend nothing
    if kind == "bool":
        return keep
    bias = torch.linspace(-1, 1, L).expand(B, 1, L, L)
    return torch.where(keep, bias, torch.finfo(torch.float32).min)


def _run(q, k, v, mask=None, causal=False):
    """Forward, a backward of a fixed output gradient, and the checks' inputs."""
    out, lse, aux = attention_forward(q, k, v, mask, causal, SCALE)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.device, q.dtype)
    dq, dk, dv = attention_backward(grad, q, k, v, out, lse, mask, causal, SCALE, aux)
    rowmax = mask_facts(mask, L)
    return out, lse, grad, dq, dk, dv, kv_stats(k, v), rowmax


def _fwd_flags(q, k, out, lse, stats, rowmax, log=None):
    log = torch.zeros(2, 7, dtype=torch.float64) if log is None else log
    return fwd_verify(q, k, out, lse, stats, log, torch.ones(1), (0, 1), SCALE, rowmax, 1.0)


def _bwd_flags(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec=None):
    rec = torch.zeros(3, 7, dtype=torch.float64) if rec is None else rec
    return bwd_verify(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, torch.ones(1),
                      (0, 1, 2), SCALE, 1.0)  # fmt: skip


@pytest.mark.parametrize("mask", [None, "causal", "bool", "float"])
def test_the_backend_kernel_is_sdpa(mask):
    q, k, v = (t.requires_grad_() for t in _operands())
    m = _mask(mask) if mask in ("bool", "float") else None
    causal = mask == "causal"
    out, lse, grad, dq, dk, dv, *_ = _run(q.detach(), k.detach(), v.detach(), m, causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=True)
    want.backward(grad)
    live = slice(None) if mask != "bool" else (0,)  # SDPA's math gives NaN on dead rows
    assert torch.allclose(out[live], want.detach()[live], atol=1e-6)
    for got, t in ((dq, q), (dk, k), (dv, v)):
        assert torch.allclose(got[live], t.grad[live], atol=1e-5)
    z = (q @ k.repeat_interleave(2, 1).mT).detach() * SCALE
    if m is not None:
        z = z + torch.zeros(()).masked_fill(~m, -math.inf) if m.dtype == torch.bool else z + m
    if causal:
        z = z.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    assert torch.allclose(lse[live], z.logsumexp(-1)[live], atol=1e-5)


@pytest.mark.parametrize("outliers", [1.0, 60.0])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "float"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_inputs_raise_no_flag(dtype, mask, outliers):
    for seed in range(3):
        q, k, v = _operands(dtype, outliers, seed)
        m = _mask(mask) if mask in ("bool", "float") else None
        out, lse, grad, dq, dk, dv, stats, rowmax = _run(q, k, v, m, mask == "causal")
        log, rec = torch.zeros(2, 7, dtype=torch.float64), torch.zeros(3, 7, dtype=torch.float64)
        assert not _fwd_flags(q, k, out, lse, stats, rowmax, log).any()
        assert not _bwd_flags(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec).any()
        assert not log.any() and not rec.any()


def test_each_forward_check_flags_its_class():
    q, k, v = _operands()
    out, lse, _, _, _, _, stats, rowmax = _run(q, k, v, None, True)

    def flags(out=out, lse=lse):
        return _fwd_flags(q, k, out, lse, stats, rowmax)

    bad = lse.clone()
    bad[1, 2, 7] = 1e4  # a near-INF score: above the row's bound
    assert flags(lse=bad).tolist() == [[0] * 4, [0, 0, 1, 0]]
    bad = lse.clone()
    bad[0, 3, 9] = -math.inf  # a whole row of -INF scores: below the bound
    assert flags(lse=bad)[0, 3] == 1
    bad = out.clone()
    bad[0, 1, 4, 5] = math.nan
    assert flags(out=bad)[0, 1] == 2
    bad = out.clone()  # outside V's range by a little more than rounding
    bad[1, 0, 6, 2] = v[1, 0, :, 2].max() * (1 + 1e-4) + 1e-4
    assert flags(out=bad)[1, 0] == 2


def test_each_backward_check_flags_its_class():
    """dV and dK are checksums: an error well below the column's size is seen (here 1e-3 of
    sum_j |dV_jf|, 2e-2 of sum_j |dK_jf|: their worst-case rounding bounds in fp32 at L 48 are
    ~2.4e-4 and ~3.7e-3 of it); dQ a bound: a near-INF value."""
    q, k, v = _operands()
    _, lse, grad, dq, dk, dv, stats, rowmax = _run(q, k, v, None, True)

    def flags(dq=dq, dk=dk, dv=dv):
        return _bwd_flags(q, k, v, lse, grad, dq, dk, dv, stats, rowmax)

    assert not flags().any()
    bad = dv.clone()
    bad[1, 0, 5, 3] += 1e-3 * dv[1, 0, :, 3].abs().sum()
    assert flags(dv=bad).tolist() == [[0, 0], [4, 0]]
    bad = dk.clone()
    bad[0, 1, 2, 7] += 2e-2 * dk[0, 1, :, 7].abs().sum()
    assert flags(dk=bad).tolist() == [[0, 2], [0, 0]]
    bad = dq.clone()
    bad[0, 3, 4, 1] = 1e10  # query head 3 is in K/V group 1
    assert flags(dq=bad).tolist() == [[0, 1], [0, 0]]


def test_the_repairs_restore_the_flagged_heads():
    q, k, v = _operands()
    out, lse, grad, dq, dk, dv, stats, rowmax = _run(q, k, v, None, True)
    log = torch.zeros(2, 7, dtype=torch.float64)
    bad_out, bad_lse = out.clone(), lse.clone()
    bad_out[1, 2, 3, :] = math.inf
    bad_lse[0, 1, 5] = math.nan
    flags = _fwd_flags(q, k, bad_out, bad_lse, stats, rowmax, log)
    fwd_repair(q, k, v, None, bad_out, bad_lse, stats, flags, log, (0, 1), True, SCALE, rowmax,
               1.0)  # fmt: skip
    assert torch.equal(bad_out, out) and torch.equal(bad_lse, lse)
    # scores: one row, context: one row over all 16 features; detected, nothing lost
    assert log[:, [0, 1, 3, 4, 5]].tolist() == [[1, 0, 0, 0, 1], [1, 16, 0, 0, 1]]
    rec = torch.zeros(3, 7, dtype=torch.float64)
    bad = [t.clone() for t in (dq, dk, dv)]
    bad[0][1, 0, 2, 2] = math.nan
    bad[2][0, 1, 9, :] += 1.0
    flags = _bwd_flags(q, k, v, lse, grad, *bad, stats, rowmax, rec)
    assert flags.tolist() == [[0, 4], [1, 0]]
    bwd_repair(q, k, v, None, out, lse, grad, *bad, stats, rowmax, flags, rec, (0, 1, 2), True,
               SCALE, 1.0)  # fmt: skip
    for got, want in zip(bad, (dq, dk, dv), strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    assert rec[:, [3, 4, 5]].tolist() == [[0, 0, 1], [0, 0, 0], [0, 0, 1]]


def test_an_error_the_operands_imply_is_lost_and_reproduced():
    """A NaN in V: O is NaN wherever it is attended, and so is the recomputation."""
    q, k, v = _operands()
    v[0, 1, 3, 0] = math.nan
    out, lse, _, _, _, _, stats, rowmax = _run(q, k, v, None, True)
    log = torch.zeros(2, 7, dtype=torch.float64)
    flags = _fwd_flags(q, k, out, lse, stats, rowmax, log)
    assert flags[0].tolist() == [0, 0, 2, 2] and not flags[1].any()  # V head 1: q heads 2, 3
    fwd_repair(q, k, v, None, out, lse, stats, flags, log, (0, 1), True, SCALE, rowmax, 1.0)
    assert log[1, [3, 4, 5]].tolist() == [1, 1, 1]  # lost, reproduced, detected
