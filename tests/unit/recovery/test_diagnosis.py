"""recovery.diagnosis on hand-made events: what a step's finding says (corrected or beyond
repair, healthy), the per-rank tally, and which rank stands out (hypothesis)."""

from __future__ import annotations

import statistics

from hypothesis import given
from hypothesis import strategies as st

from attnchecker import ABFTConfig
from attnchecker.models import Event
from attnchecker.recovery.diagnosis import (
    VERDICT,
    Finding,
    Here,
    RankCounts,
    classify,
    gather,
    here,
    outliers,
    tally,
)

HERE = Here(1, "node7", "cuda:0")


def _event(op: str, *, layer: int = 0, action: str = "corrected", count: int = 1,
           cause: str = "fault") -> Event:  # fmt: skip
    return Event(step=4, module=f"model.layers.{layer}.self_attn", layer=layer, op=op,
                 pattern="0D", kind="inf", action=action, n_rows=1, n_cols=1, count=count,
                 cause=cause)  # fmt: skip


def test_a_healthy_step_has_no_finding():
    assert classify([], step=3, loss=2.5, history=[2.6, 2.7, 2.5], where=HERE) is None
    assert classify([], step=3, where=HERE) is None  # no loss given, no event


def test_a_fault_beyond_repair_makes_the_step_untrainable_and_says_so():
    events = [_event("scores", layer=1, count=2),
              _event("context", layer=1, action="uncorrectable")]  # fmt: skip
    f = classify(events, step=4, loss=float("nan"), where=HERE, config=ABFTConfig())
    assert isinstance(f, Finding)
    assert (f.cause, f.verdict, f.trainable, f.step) == ("fault", VERDICT["fault"], False, 4)
    assert "2 corrected, 1 beyond repair (step skipped)" in f.message
    assert str(HERE) in f.message and f.where == str(HERE) == "rank 1, host node7, device cuda:0"
    assert f.ops == ("layer 1 scores", "layer 1 context")  # execution order, not list order
    assert f.to_dict()["type"] == "diagnosis" and f.to_dict()["ops"] == f.ops


def test_a_fault_outweighs_numerics_in_the_same_step():
    events = [_event("q", cause="numerics"), _event("out", layer=1)]
    f = classify(events, step=4, where=HERE)
    assert f.cause == "fault" and f.ops == ("layer 1 out",)


def test_tally_counts_faults_per_op_and_numerics_per_step():
    counts = RankCounts(2, "h", "cpu")
    faults = [_event("q", count=3), _event("q", action="uncorrectable"), _event("dv")]
    tally(counts, faults, classify(faults, step=1, where=HERE))
    numerics = [_event("scores", cause="numerics", count=5)]
    tally(counts, numerics, classify(numerics, step=2, where=HERE))
    tally(counts, [], None)
    assert (counts.steps, counts.faults, counts.uncorrectable, counts.numerics) == (3, 5, 1, 1)
    assert counts.by_op == {"q": 4, "dv": 1}  # numerics are no computation fault
    assert str(counts) == (
        "rank 2, host h, device cpu: 4 corrected and 1 uncorrectable fault(s) in 3 steps"
    )
    assert counts.to_dict()["by_op"] == {"q": 4, "dv": 1}


def test_without_a_process_group_gather_is_this_rank_and_here_is_rank_0(monkeypatch):
    counts = RankCounts(0, "h", "cpu", steps=3)
    assert gather(counts) == [counts]
    monkeypatch.setenv("ATTNCHECKER_HOST", "bench-3")
    assert here() == Here(0, "bench-3", "cpu")
    assert here("cpu").device == "cpu"


@given(
    faults=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    factor=st.floats(1.5, 10.0),
)
def test_only_ranks_with_faults_standing_out_are_named(faults, factor):
    def named(counts: list[int]) -> list[int]:
        ranks = [RankCounts(r, f"h{r}", "cpu", steps=10, faults=n) for r, n in enumerate(counts)]
        found = outliers(ranks, factor=factor)
        assert all("fault(s) in 10 steps; others " in s for s in found)
        return [int(s.split(",")[0].removeprefix("rank ")) for s in found]

    got = named(faults)
    assert got == sorted(set(got))  # in rank order, each once
    for r in got:
        others = sorted(n for i, n in enumerate(faults) if i != r)
        assert faults[r] > 0
        if others:  # above the others' median
            assert faults[r] > statistics.median(others)
        assert r in named([*faults[:r], faults[r] + 7, *faults[r + 1 :]])  # more: still named
    if len(faults) > 1 and len(set(faults)) == 1:  # every rank alike: nobody stands out
        assert got == []
    if len(faults) == 1 and (faults[0] == 0 or faults[0] >= factor):  # a lone rank: others none
        assert got == ([0] if faults[0] else [])
