"""recovery.checkpoint on a plain model: what a checkpoint holds, which are kept, bad input."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnchecker.errors import CheckpointError, ConfigError
from attnchecker.recovery import CheckpointManager, NonTrainableDetector


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_a_checkpoint_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    model, opt, sched = _trained()
    mgr = CheckpointManager(tmp_path, every=1)
    mgr.save(7, model, opt, sched, note="x")
    want_rng = torch.rand(3)  # what the next draw is after the save
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_lr, want_step = sched.get_last_lr(), opt.state_dict()["state"][0]["step"]
    other, other_opt, other_sched = _trained(seed=1)
    other_sched.step()
    meta = mgr.load(7, other, other_opt, other_sched)
    assert meta["step"] == 7 and meta["extra"] == {"note": "x"}
    assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
    assert other_sched.get_last_lr() == want_lr
    assert torch.equal(other_opt.state_dict()["state"][0]["step"], want_step)
    assert torch.equal(torch.rand(3), want_rng)  # the RNG state came back too


def test_only_the_newest_keep_are_kept_and_due_follows_every(tmp_path):
    model, opt, _ = _trained()
    mgr = CheckpointManager(tmp_path, every=3, keep=2)
    assert [s for s in range(1, 10) if mgr.due(s)] == [3, 6, 9]
    for s in (3, 6, 9):
        mgr.save(s, model, opt)
    assert mgr.steps() == [6, 9]
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written left behind
    mgr.clear()
    assert mgr.steps() == []


def test_restore_skips_a_corrupt_newest_checkpoint(tmp_path):
    model, opt, _ = _trained()
    mgr = CheckpointManager(tmp_path, every=1, keep=3)
    mgr.save(1, model, opt)
    mgr.save(2, model, opt)
    (tmp_path / "step-000002" / "meta.json").unlink()
    assert mgr.restore(model, opt)["step"] == 1
    with pytest.raises(CheckpointError, match="unreadable"):
        mgr.load(2, model, opt)


@pytest.mark.parametrize(("every", "keep"), [(0, 1), (1, 0)])
def test_bad_settings_are_config_errors(tmp_path, every, keep):
    with pytest.raises(ConfigError, match="every and keep must be >= 1"):
        CheckpointManager(tmp_path, every=every, keep=keep)


@given(
    losses=st.lists(st.floats(0.1, 10.0), min_size=3, max_size=20),
    factor=st.floats(2.0, 20.0),
)
def test_finite_losses_under_the_factor_are_never_flagged(losses, factor):
    """A loss is a spike only above factor x the largest warm-up loss."""
    d = NonTrainableDetector(factor=factor, warmup=3)
    assert [d(x, 1.0) for x in losses[:3]] == [None] * 3
    ceiling = factor * max(losses[:3])
    for x in losses[3:]:
        assert d(x, 1.0) == ("spike" if x > ceiling else None)
    assert d(ceiling * 1.01, 1.0) == "spike"
    assert d(math.nan, 1.0) == d(1.0, -math.inf) == "non_finite"
