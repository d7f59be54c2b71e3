"""The record store (attention.records): one layout for the forward's log, the backward's sink
and the fused kernels' counters, as the handle reads it."""

import math

import torch

from attnchecker.attention.ops import GRAD_OPS, OPS
from attnchecker.attention.records import RECORD_FIELDS, Records, new_log

STEP = torch.tensor([5.0], dtype=torch.float64)


def _row(records: Records, rows: torch.Tensor, name: str) -> dict[str, float]:
    i = records.names.index(name)
    return dict(zip(RECORD_FIELDS, rows[i].tolist(), strict=True))


def test_noted_records_are_committed_to_their_ops_rows():
    r = Records(OPS, GRAD_OPS, new_log(torch.device("cpu")), backward=True)
    clean = torch.zeros(1, 5)
    flagged = torch.tensor([[2.0, 0.0, math.inf, 0.0, 0.0]])  # two rows, delivered inf
    r.note(("q", "k"), torch.cat([clean, flagged]))
    r.commit(STEP, "eager")
    rows = r.rows(STEP)
    assert rows.shape == (len(OPS) + len(GRAD_OPS), len(RECORD_FIELDS))
    assert r.names == (*OPS, *GRAD_OPS)
    assert _row(r, rows, "q") == dict.fromkeys(RECORD_FIELDS, 0.0)  # clean: nothing leaks
    k = _row(r, rows, "k")
    assert (k["n_rows"], k["value"], k["detected"], k["step_sum"]) == (2, math.inf, 1, 5)
    assert float(r.lost()) == 0.0


def test_backward_records_arrive_as_the_sinks_gradient():
    r = Records(OPS, GRAD_OPS, new_log(torch.device("cpu")), backward=True)
    grad = torch.zeros(len(GRAD_OPS), len(RECORD_FIELDS), dtype=torch.float64)
    grad[GRAD_OPS.index("dv")] = torch.tensor([1, 1, math.nan, 1, 0, 1, 5], dtype=torch.float64)
    (r.sink * grad).sum().backward()  # as autograd delivers a check region's records
    rows = r.rows(STEP)
    dv = _row(r, rows, "dv")
    assert dv["lost"] == 1 and dv["detected"] == 1 and math.isnan(dv["value"])
    assert float(r.lost()) == 1.0
    r.reset()
    assert not r.rows(STEP).abs().sum() and float(r.lost()) == 0.0


def test_the_kernels_counters_read_as_rows_of_the_same_layout():
    from attnchecker.kernels import CHECKS

    r = Records(OPS, GRAD_OPS, new_log(torch.device("cpu")), kernel_checks=CHECKS)
    assert r.kernel is not None and r.names[-len(CHECKS) :] == CHECKS
    r.kernel[CHECKS.index("s")] = torch.tensor([2, 1, 1], dtype=torch.int32)  # det, corr, unc
    rows = r.rows(STEP)
    s = _row(r, rows, "s")
    assert (s["detected"], s["lost"], s["n_rows"], s["step_sum"]) == (2, 1, 2, 10)
    assert math.isnan(s["value"])  # the kernels report no value
    clean = _row(r, rows, "pv")
    assert clean == dict.fromkeys(RECORD_FIELDS, 0.0)  # no NaN where nothing was detected
    assert float(r.lost()) == 1.0
    r.reset()
    assert int(r.kernel.sum()) == 0


def test_records_follow_the_model_to_another_device_with_what_they_hold():
    """A model moved after protect_: the root hook moves every store (here to the same device
    type, the path a .cuda() takes; tests/integration/test_gpu.py moves to a GPU): the log and
    what the backward had collected are kept, and the sink is a new leaf that collects again."""
    r = Records(OPS, GRAD_OPS, new_log(torch.device("cpu")), backward=True)
    r.note(("q",), torch.tensor([[1.0, 0.0, math.inf, 0.0, 0.0]]))
    r.commit(STEP, "eager")
    grad = torch.zeros(len(GRAD_OPS), len(RECORD_FIELDS), dtype=torch.float64)
    grad[GRAD_OPS.index("dv"), 0] = 3.0
    (r.sink * grad).sum().backward()
    before, old_sink = r.rows(STEP), r.sink
    r.to(torch.device("cpu"))
    assert r.sink is not old_sink and r.sink.is_leaf and r.sink.requires_grad
    assert torch.equal(r.rows(STEP), before)
    (r.sink * grad).sum().backward()  # collects on top of what it carried
    assert float(r.rows(STEP)[r.names.index("dv"), 0]) == 6.0
