"""The loop's parts: a run set up by ``TrainState.build``, one ``train_step`` (forward, backward,
one read back), and the faults ``train --fault-rate`` samples."""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from attnchecker.inject.kinds import DEFAULT_KINDS
from attnchecker.train.loop import TrainConfig, TrainState, sampled_faults, train, train_step

CFG = TrainConfig(family="gpt2", size="tiny", steps=2, batch=2, seq_len=16)


def test_the_loops_first_step_is_train_step(tmp_path):
    state = TrainState.build(CFG, tmp_path / "state")
    result = train_step(state)
    assert math.isfinite(result.loss) and result.grad_norm > 0 and not result.skip
    assert all(p.grad is not None for p in state.model.parameters() if p.requires_grad)
    assert state.step == 0  # nothing updated: the loop decides
    assert json.loads((tmp_path / "state" / "meta.json").read_text())["config"]["steps"] == 2
    train(CFG, tmp_path / "run", progress=False)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    assert first["loss"] == result.loss and first["grad_norm"] == result.grad_norm


def test_a_nan_weight_makes_the_step_non_finite_and_a_guarded_run_has_its_guard(tmp_path):
    from attnchecker.attention.config import ABFTConfig

    state = TrainState.build(CFG, tmp_path / "plain")
    assert state.handle is None and state.guarded is None and state.ckpt is None
    with torch.no_grad():
        next(state.model.parameters()).fill_(float("nan"))
    result = train_step(state)
    assert not math.isfinite(result.loss) and state.detector(result.loss, result.grad_norm)
    cfg = dataclasses.replace(CFG, protect=True, abft=ABFTConfig(policy="skip_step"),
                              recovery="checkpoint")  # fmt: skip
    state = TrainState.build(cfg, tmp_path / "guarded")
    assert state.handle is not None and state.guarded is not None and state.ckpt is not None
    assert not train_step(state).skip  # a clean step


def test_sampled_faults_follow_the_rate():
    assert sampled_faults(0.0, 10, seed=0) is None
    assert len(sampled_faults(0.01, 10, seed=0).faults) == 1  # at least one
    plan = sampled_faults(0.5, 20, seed=3)
    assert len(plan.faults) == 10
    assert all(1 <= f.step <= 20 and f.kind in DEFAULT_KINDS for f in plan.faults)
    assert plan.to_json() == sampled_faults(0.5, 20, seed=3).to_json()  # seeded
