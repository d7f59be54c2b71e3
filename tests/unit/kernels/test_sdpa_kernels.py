"""The SDPA route's Triton kernels (``attnchecker.kernels.sdpa_kernels``, in the interpreter
here) against their torch reference (``sdpa_check``): the same flags on clean and corrupted
results (fp32 and bf16; causal, a bool mask with rows that attend nothing, GQA), repairs that
restore the flagged heads to the backend's values, the records' counts, and nothing written on a
clean call."""

from __future__ import annotations

import math

import pytest
import torch

from attnchecker.kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")

from attnchecker.kernels import sdpa_backend as backend  # noqa: E402
from attnchecker.kernels import sdpa_check as ref  # noqa: E402
from attnchecker.kernels import sdpa_kernels as kern  # noqa: E402
from attnchecker.kernels import sdpa_kernels_bwd as kb  # noqa: E402

from .test_sdpa_check import SCALE, _mask, _operands, _run  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU
CASES = [("fp32", None), ("fp32", "bool"), ("bf16", None)]
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case(dtype, mask):
    q, k, v = (t.to(DEVICE) for t in _operands(DTYPE[dtype]))
    m = _mask(mask).to(DEVICE) if mask else None
    return (q, k, v, m, mask is None, *_run(q, k, v, m, mask is None))


def _fwd(q, k, v, m, causal, out, lse, rowmax):
    """The kernels' forward check and repair on (out, lse) in place: the log."""
    log = torch.zeros(2, 7, dtype=torch.float64, device=DEVICE)
    stats = kern.kv_stats(k, v)
    flags = kern.fwd_verify(q, k, out, lse, stats, rowmax, SCALE, 1.0)
    kern.fwd_repair(q, k, v, backend.backend_mask(m, q), out, lse, stats, rowmax, flags, log,
                    torch.ones(1, device=DEVICE), (0, 1), causal, SCALE, 1.0)  # fmt: skip
    return log


def _bwd(q, k, v, m, causal, out, lse, grad, dq, dk, dv, rowmax):
    rec = torch.zeros(3, 7, dtype=torch.float64, device=DEVICE)
    stats = kern.kv_stats(k, v)
    part, flags = kb.bwd_rows(q, k, lse, grad, dq, stats, rowmax, SCALE, 1.0)
    sums = kb.bwd_cols(dk, dv)
    kb.bwd_repair(q, k, v, backend.backend_mask(m, q), out, lse, grad, dq, dk, dv, stats, rowmax,
                    part, flags, sums, rec, torch.ones(1, device=DEVICE), (0, 1, 2), causal,
                    SCALE, 1.0)  # fmt: skip
    return rec


@pytest.mark.parametrize(("dtype", "mask"), CASES)
def test_the_stats_are_the_references(dtype, mask):
    _, k, v, *_ = _case(dtype, mask)
    got = ref.reduce_stats(kern.kv_stats(k, v))
    assert torch.allclose(got, ref.kv_stats(k, v), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("dtype", "mask"), CASES)
def test_a_clean_call_writes_nothing(dtype, mask):
    q, k, v, m, causal, out, lse, grad, dq, dk, dv, _, rowmax = _case(dtype, mask)
    was = [t.clone() for t in (out, lse, dq, dk, dv)]
    assert not _fwd(q, k, v, m, causal, out, lse, rowmax).any()
    assert not _bwd(q, k, v, m, causal, out, lse, grad, dq, dk, dv, rowmax).any()
    assert all(torch.equal(a, b) for a, b in zip((out, lse, dq, dk, dv), was, strict=True))


@pytest.mark.parametrize(("dtype", "mask"), CASES)
def test_the_forward_repair_restores_the_flagged_heads(dtype, mask):
    q, k, v, m, causal, out, lse, *_, rowmax = _case(dtype, mask)
    bad_out, bad_lse = out.clone(), lse.clone()
    bad_out[0, 2, 30, :] = math.inf  # a live row of every case
    bad_lse[1, 1, 40] = math.nan
    want = torch.zeros(2, 7, dtype=torch.float64, device=DEVICE)  # the reference's records
    flags = ref.fwd_verify(q, k, bad_out, bad_lse, ref.kv_stats(k, v), want,
                           torch.ones(1, device=DEVICE), (0, 1), SCALE, rowmax, 1.0)  # fmt: skip
    assert flags.tolist() == [[0, 0, 2, 0], [0, 1, 0, 0]]
    log = _fwd(q, k, v, m, causal, bad_out, bad_lse, rowmax)
    tol = 1e-5 if dtype == "fp32" else 1e-2
    assert torch.allclose(bad_out.float(), out.float(), atol=tol)
    assert torch.allclose(bad_lse, lse, atol=tol)
    # rows, detected, step (the same as the reference's), nothing lost
    assert log[:, [0, 3, 4, 5, 6]].tolist() == want[:, [0, 3, 4, 5, 6]].tolist()
    assert log[1, 1] == want[1, 1] == 16


@pytest.mark.parametrize(("dtype", "mask"), CASES)
def test_the_backward_repair_restores_the_flagged_groups(dtype, mask):
    q, k, v, m, causal, out, lse, grad, dq, dk, dv, _, rowmax = _case(dtype, mask)
    bad = [t.clone() for t in (dq, dk, dv)]
    bad[0][0, 3, 20, 2] = math.nan  # query head 3: group 1
    bad[1][1, 0, 7, :] += 1e3 * dk[1, 0].abs().max()
    want = torch.zeros(3, 7, dtype=torch.float64, device=DEVICE)
    flags = ref.bwd_verify(q, k, v, lse, grad, *bad, ref.kv_stats(k, v), rowmax, want,
                           torch.ones(1, device=DEVICE), (0, 1, 2), SCALE, 1.0)  # fmt: skip
    assert flags.tolist() == [[0, 1], [2, 0]]
    rec = _bwd(q, k, v, m, causal, out, lse, grad, *bad, rowmax)
    tol = 1e-5 if dtype == "fp32" else 5e-2
    for got, clean in zip(bad, (dq, dk, dv), strict=True):
        assert torch.allclose(got.float(), clean.float(), atol=tol)
    assert rec[:, [0, 1, 3, 4, 5, 6]].tolist() == want[:, [0, 1, 3, 4, 5, 6]].tolist()


def test_an_error_the_operands_imply_is_lost_and_reproduced():
    q, k, v, m, causal, out, lse, *_, rowmax = _case("fp32", None)
    v = v.clone()
    v[0, 1, 3, 0] = math.nan  # O is NaN wherever it attends key 3, and so is the repair
    out, lse, _ = backend.attention_forward(q, k, v, None, True, SCALE)
    log = _fwd(q, k, v, m, causal, out, lse, rowmax)
    assert log[1, [3, 4, 5]].tolist() == [1, 1, 1]
