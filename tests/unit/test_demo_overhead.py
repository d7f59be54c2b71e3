"""The training demo's overhead column: alternated rounds, a median with its interval, and no
figure that contradicts the work done (pure: summaries and round times, no training)."""

from __future__ import annotations

import pytest

from attnchecker.report.training import arm_row

TIMING = {"arms_in_turn": ["reference", "protected"], "untimed_per_turn": 1,
          "timed_per_turn": 3, "rounds": 6}  # fmt: skip


def _arm(**kw):
    s = {"faults_injected": 3, "faults_detected": 3, "faults_corrected": 3, "final_loss": 6.1,
         "non_trainable": False, "wall_time_s": 12.0, "saves": 0, "overhead": None,
         "overhead_interval": None}  # fmt: skip
    return {**s, **kw}


def test_overhead_is_shown_with_its_interval():
    summary = {"protected": _arm(overhead=0.36, overhead_interval=[0.31, 0.41])}
    assert arm_row("protected", summary)[7] == "+36% [+31, +41]"


def test_no_overhead_without_an_interval():
    """A summary from before intervals (or too few rounds) has a point and no interval."""
    assert arm_row("protected", {"protected": _arm(overhead=0.36)})[7] == "n/a"


def test_more_work_measured_as_less_is_a_measurement_problem():
    """Issue 21: checkpoint_restore -25% while it does strictly more work than the reference."""
    ckpt = _arm(overhead=-0.25, overhead_interval=[-0.3, -0.2])
    summary = {"timing": TIMING, "reference": _arm(faults_injected=0), "checkpoint_restore": ckpt}
    cell = arm_row("checkpoint_restore", summary)[7]
    assert cell == "measurement problem" and "%" not in cell
    from attnchecker.report.training import overhead_note

    note = overhead_note(summary)
    assert "measurement problem" in note and "took turns" in note
    # an interval that reaches 0 is an overhead within the noise: shown
    summary["checkpoint_restore"]["overhead_interval"] = [-0.3, 0.01]
    assert arm_row("checkpoint_restore", summary)[7] == "-25% [-30, +1]"
    assert "measurement problem" not in overhead_note(summary)


def test_overheads_pair_rounds_and_skip_those_an_arm_did_not_run_through():
    from attnchecker.demo import _overheads

    times = {"reference": [1.0, 1.0, 5.0, 1.0, 1.0, 1.0],
             "protected": [1.3, 1.4, 6.5, 1.2, 1.3, 9.0],
             "unprotected": [1.0, 0.1, 0.0, 0.0, 0.0, 0.0]}  # fmt: skip
    live = (
        [{"reference", "protected", "unprotected"}]
        + [{"reference", "protected"}] * 4
        + [{"reference"}]
    )
    est, n = _overheads(times, live)["protected"]
    # the burst of load in round 3 hit both arms: its ratio is 1.3, like the others
    assert n == 5 and est.point == pytest.approx(0.3) and est.low <= est.point <= est.high
    assert est.low == pytest.approx(0.2) and est.high == pytest.approx(0.4)
    assert _overheads(times, live)["unprotected"] == (None, 1)  # one round: no interval
