"""The SDPA route's Triton kernels write the same bytes whatever order their programs run in
(issue 54: a GPU hands blocks out in its own order, and runs them at once): each launch re-run
reversed, in a GPU's order (x fastest) and shuffled
(:func:`attnchecker.kernels.launches.program_order`), with faults in several heads and groups
so that several programs repair and record, every output and scratch compared byte for byte
with the interpreter's order. The records are the reference's where the reference defines
them (the forward's value: the delivered value at the worst excess)."""

from __future__ import annotations

import math

import pytest
import torch

from attnchecker.kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")

from attnchecker.kernels import sdpa_check as ref  # noqa: E402
from attnchecker.kernels import sdpa_kernels as kern  # noqa: E402
from attnchecker.kernels import sdpa_kernels_bwd as kb  # noqa: E402
from attnchecker.kernels.launches import program_order, recorded  # noqa: E402

from .test_sdpa_check import SCALE, _operands, _run  # noqa: E402

ORDERS = ("reversed", "gpu", "random")


def _faulty():
    q, k, v = _operands(torch.float32)
    out, lse, grad, dq, dk, dv, _, rowmax = _run(q, k, v, None, True)
    out, lse, dq, dk, dv = (t.clone() for t in (out, lse, dq, dk, dv))
    out[0, 2, 30, :] = math.inf  # two heads' O, one head's LSE, several blocks
    out[1, 3, 5, 4] += 50.0
    out[1, 3, 40, 1] = -math.inf
    lse[1, 1, 40] = math.nan
    lse[0, 0, 7] += 80.0
    dq[0, 3, 20, 2] = math.nan  # dQ in two groups, dK and dV in two groups
    dq[1, 0, 3, 1] += 1e3
    dk[1, 0, 7, :] += 1e3 * dk[1, 0].abs().max()
    dk[0, 1, 2, 5] = math.inf
    dv[0, 1, 9, 3] -= 1e3 * dv[0, 1].abs().max()
    return q, k, v, out, lse, grad, dq, dk, dv, rowmax


def _run_all(q, k, v, out, lse, grad, dq, dk, dv, rowmax) -> dict[str, torch.Tensor]:
    out, lse, dq, dk, dv = (t.clone() for t in (out, lse, dq, dk, dv))
    step = torch.ones(1)
    log = torch.zeros(2, 7, dtype=torch.float64)
    stats = kern.kv_stats(k, v)
    flags = kern.fwd_verify(q, k, out, lse, stats, rowmax, SCALE, 1.0)
    fflags = flags.clone()
    kern.fwd_repair(q, k, v, None, out, lse, stats, rowmax, flags, log, step, (0, 1), True,
                    SCALE, 1.0)  # fmt: skip
    rec = torch.zeros(3, 7, dtype=torch.float64)
    part, bflags = kb.bwd_rows(q, k, lse, grad, dq, stats, rowmax, SCALE, 1.0)
    sums = kb.bwd_cols(dk, dv)
    kb.bwd_repair(q, k, v, None, out, lse, grad, dq, dk, dv, stats, rowmax, part, bflags, sums,
                  rec, step, (0, 1, 2), True, SCALE, 1.0)  # fmt: skip
    return {"stats": stats, "fwd_flags": fflags, "flags": flags, "out": out, "lse": lse,
            "log": log, "part": part, "bwd_flags": bflags, "sums": sums, "dq": dq, "dk": dk,
            "dv": dv, "rec": rec}  # fmt: skip


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    return a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.fixture(scope="module")
def in_order():
    case = _faulty()
    with recorded() as launches:
        got = _run_all(*case)
    return case, got, launches


def test_the_faults_are_repaired_and_recorded_as_the_reference_does(in_order):
    case, got, launches = in_order
    q, k, v, out, lse, grad, dq, dk, dv, rowmax = case
    clean = _run(q, k, v, None, True)
    for name, want in (("out", clean[0]), ("lse", clean[1]), ("dq", clean[3]), ("dk", clean[4]),
                       ("dv", clean[5])):  # fmt: skip
        assert torch.allclose(got[name], want, atol=1e-5), name
    want = torch.zeros(2, 7, dtype=torch.float64)
    ref.fwd_verify(q, k, out, lse, ref.kv_stats(k, v), want, torch.ones(1), (0, 1), SCALE, rowmax,
                   1.0)  # fmt: skip
    torch.testing.assert_close(got["log"], want, equal_nan=True, rtol=0, atol=0)
    rec = torch.zeros(3, 7, dtype=torch.float64)
    ref.bwd_verify(q, k, v, got["lse"], grad, dq, dk, dv, ref.kv_stats(k, v), rowmax, rec,
                   torch.ones(1), (0, 1, 2), SCALE, 1.0)  # fmt: skip
    assert got["rec"][:, [0, 1, 5, 6]].tolist() == rec[:, [0, 1, 5, 6]].tolist()
    assert got["rec"][:, 0].tolist() == [2, 2, 1]  # dQ rows; dK's and dV's groups
    assert not got["rec"][:, 3].any() and not got["log"][:, 3].any()  # nothing lost
    # the repairs ran on several programs each
    assert [n.kernel for n in launches] == ["kv_stats_kernel", "fwd_verify_kernel",
        "fwd_repair_kernel", "bwd_q_kernel", "bwd_kv_kernel", "bwd_check_kernel",
        "bwd_repair_q_kernel", "bwd_repair_kv_kernel"]  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
def test_every_byte_is_the_same_in_any_program_order(in_order, order):
    case, want, _ = in_order
    with program_order(order):
        got = _run_all(*case)
    differ = [name for name in want if not _same(got[name], want[name])]
    assert not differ, differ
