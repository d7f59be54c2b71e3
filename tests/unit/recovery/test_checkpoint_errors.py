"""recovery.checkpoint: what is refused as a CheckpointError (a flipped byte, a step never saved,
another architecture's checkpoint), what is stored once (tied weights), and a round trip of any
optimizer state (hypothesis)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

from attnchecker.errors import CheckpointError
from attnchecker.models.tiny import build
from attnchecker.recovery import CheckpointManager
from attnchecker.recovery.checkpoint import save_weights


def _net(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))


def _stepped(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(5, 3, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def test_one_flipped_byte_in_the_tensors_is_caught_by_the_hash(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _stepped(model, opt)
    path = CheckpointManager(tmp_path, every=1).save(1, model, opt)
    f = path / "tensors.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's payload: the file still parses
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        CheckpointManager(tmp_path, every=1).load(1, model, opt)


def test_a_step_never_saved_and_an_empty_directory_are_refused(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(tmp_path / "ckpt", every=1)
    assert (tmp_path / "ckpt").is_dir() and mgr.steps() == []
    with pytest.raises(CheckpointError, match="unreadable"):
        mgr.load(5, model, opt)
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        mgr.restore(model, opt)


def test_another_architectures_checkpoint_is_refused(tmp_path):
    small, big = nn.Linear(3, 2), nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    mgr = CheckpointManager(tmp_path, every=1)
    mgr.save(1, small, torch.optim.SGD(small.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="lacks"):
        mgr.load(1, big, torch.optim.SGD(big.parameters(), lr=0.1))


def test_saving_a_step_again_replaces_it_atomically(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(tmp_path, every=1, keep=3)
    mgr.save(2, model, opt, note="first")
    _stepped(model, opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.save(2, model, opt, note="second")
    assert mgr.steps() == [2] and not list(tmp_path.glob(".tmp-*"))
    fresh = _net()
    meta = mgr.load(2, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    assert meta["extra"] == {"note": "second"}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


def test_tied_weights_are_stored_once_in_both_files(tmp_path):
    """GPT-2's lm_head is its token embedding: one tensor in the checkpoint and the weights file."""
    model = build("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CheckpointManager(tmp_path / "c", every=1).save(1, model, opt)
    keys = set(load_file(str(ckpt / "tensors.safetensors")))
    assert "model.transformer.wte.weight" in keys and "model.lm_head.weight" not in keys
    save_weights(model, tmp_path / "w.safetensors")
    stored = load_file(str(tmp_path / "w.safetensors"))
    assert len([k for k in stored if k.endswith(("wte.weight", "lm_head.weight"))]) == 1
    assert len(stored) == len({p.data_ptr() for p in model.state_dict().values()})


@settings(max_examples=15)
@given(
    lr=st.floats(1e-4, 1e-1),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    steps=st.integers(1, 3),
    width=st.integers(1, 6),
)
def test_any_optimizer_state_comes_back_exactly(tmp_path_factory, lr, momentum, steps, width):
    model = _net(width)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    _stepped(model, opt, steps)
    directory = tmp_path_factory.mktemp("ckpt")
    path = CheckpointManager(directory, every=1).save(steps, model, opt)
    assert json.loads((path / "meta.json").read_text())["step"] == steps
    other = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5)
    CheckpointManager(directory, every=1).restore(other, other_opt)
    assert (
        other_opt.param_groups[0]["lr"] == lr and other_opt.param_groups[0]["momentum"] == momentum
    )
    want, got = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert want.keys() == got.keys()
    for pid, s in want.items():
        assert s.keys() == got[pid].keys()
        for k, v in s.items():
            assert torch.equal(v, got[pid][k]) if torch.is_tensor(v) else v == got[pid][k]
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
