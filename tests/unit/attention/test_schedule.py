"""The schedule value (attention.schedule) and the op table (attention.ops) it speaks."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.ops import (
    ALL_OPS,
    CORE_GRAD_OPS,
    GRAD_OPS,
    LINEAR_OPS,
    OP_TABLE,
    OPS,
    op,
)
from attnchecker.attention.schedule import Schedule


def test_the_op_tuples_are_read_off_the_table():
    names = [o.name for o in OP_TABLE]
    assert len(names) == len(set(names))  # one entry per op
    assert OPS == ("q", "k", "v", "scores", "probs", "context", "out")
    assert GRAD_OPS[:4] == CORE_GRAD_OPS == ("dq", "dk", "dp", "dv")
    assert set(GRAD_OPS[4:]) == {f"d{g}.{s}" for g in "xw" for s in ("q", "k", "v", "out")}
    assert ALL_OPS == OPS + GRAD_OPS and LINEAR_OPS == ("y", "dx", "dw")
    assert all(o.backward == o.name.startswith("d") for o in OP_TABLE)
    assert op("dk").engine.endswith("checked_matmul") and op("scores").part == "core"


def test_stages_order_one_layer_pass():
    """Forward: projections before scores before probabilities before context before the
    output projection; backward: the output projection's gradients before dP / dV, before
    dQ / dK, before the Q / K / V projections'."""
    fwd = [op(n).stage for n in ("q", "scores", "probs", "context", "out", "y")]
    bwd = [op(n).stage for n in ("dx", "dx.out", "dv", "dq", "dx.q")]
    assert fwd == sorted(fwd) and len(set(fwd)) == len(fwd)
    assert bwd == sorted(bwd) and len(set(bwd)) == len(bwd)


def test_without_entries_every_bound_layer_checks_the_ops_on_every_step():
    s = Schedule(("q", "scores"), layers=(1,))
    assert s.period == 1
    assert s.layer_ops(1) == {"q", "scores"} and s.layer_ops(0) == frozenset()
    s.bind("m1", 1)
    for _ in range(3):
        assert s.checks("m1", "q") and not s.checks("m1", "k")
        s.advance()


def test_a_periodic_entry_is_checked_on_drains_1_1_plus_k():
    s = Schedule(ALL_OPS, entries=((0, "scores", 3), (0, "q", 1)))
    s.bind("attn0", 0)
    seen = []
    for _ in range(7):  # steps 1..7
        seen.append(s.checks("attn0", "scores"))
        assert s.checks("attn0", "q")  # every step
        s.advance()
    assert seen == [True, False, False, True, False, False, True]
    assert s.ops_of("attn0", on=True) == {"q", "scores"} == s.layer_ops(0)
    assert s.ops_of("attn0", on=False) == {"q"} == s.layer_ops(0, step=2)


def test_a_module_with_fixed_ops_ignores_the_period():
    s = Schedule(ALL_OPS, entries=((0, "scores", 2),))
    s.bind("mlp.fc", 0, ("y", "dx"))
    for _ in range(4):
        assert s.ops_of("mlp.fc") == {"y", "dx"}
        s.advance()


@given(
    every=st.integers(1, 6),
    drains=st.integers(0, 30),
)
def test_the_phase_follows_the_drains_only(every, drains):
    """Whatever the number of drains, the step after them (drains + 1) is checked iff
    drains is a multiple of the period; the config answers the same for that step."""
    config = ABFTConfig(schedule=((0, "context", every),))
    s = Schedule.of(config)
    s.bind("a", 0)
    for _ in range(drains):
        s.advance()
    assert s.checks("a", "context") == (drains % every == 0)
    assert ("context" in config.layer_ops(0, step=drains + 1)) == (drains % every == 0)


def test_config_period_and_layer_ops_are_the_schedules():
    config = ABFTConfig(schedule=((0, "scores", 4), (1, "q", 1)))
    assert config.period == Schedule.of(config).period == 4
    assert config.layer_ops(1, step=2) == {"q"}


def test_an_unbound_module_is_a_key_error():
    with pytest.raises(KeyError):
        Schedule(OPS).checks("nowhere", "q")
