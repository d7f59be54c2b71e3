"""How a module's checks run, resolved once (attention.impl): the names, the environment, the
registered ops where they can run, and a state that follows its module to another device."""

from __future__ import annotations

import pytest
import torch

from attnchecker import kernels
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.impl import ENV, CheckImpl, Impl, resolve
from attnchecker.attention.records import new_log
from attnchecker.attention.state import AttentionState, Clock
from attnchecker.errors import ConfigError

CPU = torch.device("cpu")


def test_a_named_implementation_is_taken_whatever_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "compiled")
    assert resolve("eager", CPU) == Impl("eager", half=CheckImpl.EAGER, fp32=CheckImpl.EAGER)
    assert resolve("auto", CPU).name == "compiled"  # only "auto" defers to it
    monkeypatch.setenv(ENV, "nonsense")
    with pytest.raises(ConfigError, match=ENV):
        resolve("auto", CPU)


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or its interpreter)")
def test_triton_runs_the_registered_ops_where_they_can_run():
    how = resolve("triton", CPU)  # here: Triton's interpreter
    assert how.name == "triton" and how.kernels
    # the regions without kernels of their own run as "auto" would run them
    assert how.region(torch.float32) is resolve("auto", CPU).region(torch.float32)


def test_the_region_follows_the_checked_tensors_precision(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    how = Impl("auto", half=CheckImpl.COMPILED, fp32=CheckImpl.EAGER)
    assert how.region(torch.bfloat16) is how.region(torch.float16) is CheckImpl.COMPILED
    assert how.region(torch.float32) is how.region(torch.float64) is CheckImpl.EAGER


def test_a_state_holds_its_resolution_and_resolves_again_when_it_moves(monkeypatch):
    monkeypatch.setenv(ENV, "eager")
    clock = Clock(torch.zeros(1, dtype=torch.float64))
    state = AttentionState("m", 0, ABFTConfig(), clock, new_log(CPU))
    assert state.impl.name == "eager"
    monkeypatch.setenv(ENV, "compiled")  # read at protect_, not per call
    state.follow(CPU)  # already there: nothing changes
    assert state.impl.name == "eager"
    meta = torch.device("meta")  # a move: records and resolution follow it
    state.follow(meta)
    assert state.records.log.device == meta and state.impl.name == "compiled"


def test_accumulator_without_the_kernels_warns_and_says_so(monkeypatch):
    """Where the kernels cannot run (a CPU without Triton's interpreter), "accumulator" is the
    delivered-output checks; protect_ warns and summary() names it."""
    from attnchecker import protect_
    from attnchecker.models.tiny import build

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    how = resolve("accumulator", CPU)
    assert how.name == "accumulator" and not how.accumulator and not how.kernels
    model = build("llama", size="tiny")
    with pytest.warns(RuntimeWarning, match="accumulator"):
        handle = protect_(model, ABFTConfig(scope="all_linear", check_impl="accumulator"))
    acc = handle.summary()["accumulator"]
    assert acc["running"] is False and acc["on_the_accumulator"] == []
    assert handle.summary()["check_impl"] == "accumulator"


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or its interpreter)")
def test_accumulator_summary_names_what_it_covers(monkeypatch):
    from attnchecker import protect_
    from attnchecker.models.tiny import build

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    handle = protect_(build("llama", size="tiny"), ABFTConfig(check_impl="accumulator"))
    acc = handle.summary()["accumulator"]
    assert acc["running"] is True and "dw" in acc["on_the_accumulator"]
    assert "epilogue" in acc["unseen"]
    assert ABFTConfig().check_impl == "auto"  # opt-in
