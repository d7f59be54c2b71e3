"""The SDPA route with attention dropout (``attnchecker.kernels.sdpa_check``): the backend's kernel
with its own draw (a CPU's math backend, CUDA's flash / memory-efficient kernels), checks whose
bounds take the dropout (no flag on clean data in fp32, bf16, fp16, with masks and GQA), and
repairs that rerun the whole call from the generator's state before it: the repaired outputs
and gradients equal the clean ones to the bit, and the generator is left where it was.

Runs on every device here (the CPU; CUDA where there is one: the GPU stage's tests run it)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from attnchecker import kernels
from attnchecker.kernels.sdpa_backend import (
    attention_backward,
    attention_forward,
    rewound,
    rng_state,
)
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
P = 0.3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _operands(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, HKV, HKV))
    grad = torch.randn(B, H, L, D, generator=g)
    return tuple(t.to(device, dtype) for t in (q, k, v, grad))


def _padding(device):
    keep = torch.ones(B, 1, L, L, dtype=torch.bool, device=device).tril()
    keep[1, :, :, :5] = False  # sample 1's rows 0-4 attend nothing
    return keep


def _call(q, k, v, grad, mask, causal):
    """(rng, out, lse, aux, dq, dk, dv) of one dropout call and its backward."""
    rng = rng_state(q.device)
    out, lse, aux = attention_forward(q, k, v, mask, causal, SCALE, P)
    dq, dk, dv = attention_backward(grad, q, k, v, out, lse, mask, causal, SCALE, aux, P, rng)
    return rng, out, lse, aux, dq, dk, dv


def _checks(q, k, v, grad, mask, out, lse, dq, dk, dv):
    """(forward flags, backward flags, forward log, backward records) of clean checks."""
    stats, rowmax = kv_stats(k, v), mask_facts(mask, L)
    log = torch.zeros(2, 7, dtype=torch.float64, device=q.device)
    rec = torch.zeros(3, 7, dtype=torch.float64, device=q.device)
    step = torch.ones(1, device=q.device)
    f = fwd_verify(q, k, out, lse, stats, log, step, (0, 1), SCALE, rowmax, 1.0, P)
    b = bwd_verify(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step, (0, 1, 2), SCALE,
                   1.0, P)  # fmt: skip
    return f, b, log, rec


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernel_is_sdpas_own_draw_and_its_gradients(device):
    """The route's forward is ``F.scaled_dot_product_attention`` with the same generator state,
    to the bit; its backward is SDPA's autograd backward (1e-5 in fp32 on a CPU, where the
    math backend's formulas are redone in fp32; the same kernel on CUDA)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, grad = _operands(device, dtype)
    rng, out, _lse, _aux, *grads = _call(q, k, v, grad, None, True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with rewound(rng, q.device):
        want = F.scaled_dot_product_attention(*leaves, dropout_p=P, is_causal=True, scale=SCALE,
                                              enable_gqa=True)  # fmt: skip
    assert torch.equal(out, want.detach())
    wants = torch.autograd.grad(want, leaves, grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in zip(grads, wants, strict=True):
        assert float((got.float() - ref.float()).abs().max()) <= tol
    undropped = attention_forward(q, k, v, None, True, SCALE)[0]
    assert not torch.allclose(out.float(), undropped.float(), atol=1e-2)  # (it did drop)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clean_dropout_calls_raise_no_flag(device, dtype):
    """No false alarm with dropout on, over seeds, causal and padded, every dtype: the
    reference's checks, and the Triton kernels' where they run (CUDA, the interpreter)."""
    for seed in range(6):
        q, k, v, grad = _operands(device, dtype, seed)
        for mask, causal in ((None, True), (_padding(device), False)):
            _rng, out, lse, _aux, dq, dk, dv = _call(q, k, v, grad, mask, causal)
            f, b, log, rec = _checks(q, k, v, grad, mask, out, lse, dq, dk, dv)
            assert not bool(f.any()) and not bool(b.any()), (seed, causal)
            assert not bool(log[:, 5].any()) and not bool(rec[:, 5].any())
            if kernels.available() and seed == 0:
                assert not _kernel_flags(q, k, v, grad, mask, out, lse, dq, dk, dv), (seed, causal)


def _kernel_flags(q, k, v, grad, mask, out, lse, dq, dk, dv) -> bool:
    """Whether the Triton family's verify kernels flag a dropout call (forward or backward)."""
    from attnchecker.kernels import sdpa_kernels as sk
    from attnchecker.kernels import sdpa_kernels_bwd as sb

    stats, rowmax = sk.kv_stats(k, v), mask_facts(mask, L).to(q.device)
    f = sk.fwd_verify(q, k, out, lse, stats, rowmax, SCALE, 1.0, P)
    part, qflags = sb.bwd_rows(q, k, lse, grad, dq, stats, rowmax, SCALE, 1.0, P)
    _grp, scr = sb.group_check(q, k, dq, dk, dv, part, qflags, sb.bwd_cols(dk, dv), SCALE, 1.0, P)
    n = scr.numel() - k.shape[0] * k.shape[1]
    return sk.flagged(f, D) or bool(scr[:n].any())


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or the interpreter)")
def test_the_kernels_see_what_the_reference_sees_with_dropout():
    """A fault in O and one in dV, dropout on: the Triton verify kernels flag them as the
    reference does (the repair then reads the flag and takes the reference's path)."""
    q, k, v, grad = _operands("cpu", torch.float32)
    _rng, out, lse, _aux, dq, dk, dv = _call(q, k, v, grad, None, True)
    assert not _kernel_flags(q, k, v, grad, None, out, lse, dq, dk, dv)
    bad = out.clone()
    bad[0, 3, 11, 2] = 1e4
    assert _kernel_flags(q, k, v, grad, None, bad, lse, dq, dk, dv)
    bad_dv = dv.clone()
    bad_dv[1, 0, 5, 7] = 1e4
    assert _kernel_flags(q, k, v, grad, None, out, lse, dq, dk, bad_dv)


def test_no_flag_under_autocast():
    """bf16 operands under CPU autocast (as a bf16 model trains): the log-sum-exp and the
    backward's products stay fp32 (autocast would take them to bf16, and the LSE bound saw
    that: 4 false alarms in 84 steps of BERT before the fix)."""
    for seed in range(6):
        q, k, v, grad = _operands("cpu", torch.bfloat16, seed)
        q = q * 8  # peaked rows, as trained attention has: the LSE near its lower bound
        mask = None  # (no mask: nothing fp32 joins the scores)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _rng, out, lse, _aux, dq, dk, dv = _call(q, k, v, grad, mask, False)
            f, b, _log, _rec = _checks(q, k, v, grad, mask, out, lse, dq, dk, dv)
        assert lse.dtype == torch.float32  # (what the route documents and the bounds assume)
        assert not bool(f.any()) and not bool(b.any()), seed


@pytest.mark.parametrize("device", DEVICES)
def test_a_repair_redraws_the_kernels_mask(device):
    """A fault in O and one in dK, with dropout on: flagged, and the repairs (the whole call
    rerun from the generator's state before it) restore the clean outputs and gradients to
    the bit, leaving the generator where it was."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, grad = _operands(device, dtype)
    mask = _padding(device)
    rng, out, lse, _aux, dq, dk, dv = _call(q, k, v, grad, mask, False)
    stats, rowmax = kv_stats(k, v), mask_facts(mask, L)
    log = torch.zeros(2, 7, dtype=torch.float64, device=device)
    step = torch.ones(1, device=device)
    bad = out.clone()
    bad[1, 2, 9] = float("inf")
    flags = fwd_verify(q, k, bad, lse, stats, log, step, (0, 1), SCALE, rowmax, 1.0, P)
    assert int(flags[1, 2]) == 2 and int(flags.sum()) == 2
    after = rng_state(device)
    fwd_repair(q, k, v, mask, bad, lse, stats, flags, log, (0, 1), False, SCALE, rowmax, 1.0, P,
               rng)  # fmt: skip
    assert torch.equal(bad, out)
    assert torch.equal(rng_state(device), after)
    assert log[1, 5] == 1 and log[1, 3] == 0  # detected, not lost
    rec = torch.zeros(3, 7, dtype=torch.float64, device=device)
    bad_dk = dk.clone()
    bad_dk[0, 1, 7, 3] = float("nan")
    flags = bwd_verify(q, k, v, lse, grad, dq, bad_dk, dv, stats, rowmax, rec, step, (0, 1, 2),
                       SCALE, 1.0, P)  # fmt: skip
    assert int(flags[0, 1]) & 2
    new = [dq.clone(), bad_dk, dv.clone()]
    bwd_repair(q, k, v, mask, out, lse, grad, *new, stats, rowmax, flags, rec, (0, 1, 2), False,
               SCALE, 1.0, P, rng)  # fmt: skip
    for got, want in zip(new, (dq, dk, dv), strict=True):
        assert torch.equal(got, want)
    assert rec[1, 5] == 1 and rec[1, 3] == 0
    assert torch.equal(rng_state(device), after)


def test_without_the_rewind_the_repair_draws_another_mask():
    """The guard of the test above: a repair from the generator's current state (not the
    call's) gives another O, so equality there is the draw reproduced."""
    q, k, v, _grad = _operands("cpu", torch.float32)
    rng = rng_state("cpu")
    out = attention_forward(q, k, v, None, True, SCALE, P)[0]
    again = attention_forward(q, k, v, None, True, SCALE, P)[0]
    with rewound(rng, q.device):
        redrawn = attention_forward(q, k, v, None, True, SCALE, P)[0]
    assert not torch.equal(out, again) and torch.equal(out, redrawn)
