"""The user's model from a Python factory (models.factory): what reads as a factory, the
wrapper's loss, and the errors for a factory that returns no module."""

import sys
import types

import pytest
import torch
from torch import nn

from attnchecker.errors import ConfigError
from attnchecker.models.factory import OwnModel, is_factory, load_factory


@pytest.mark.parametrize(
    ("spec", "factory"),
    [("pkg.mod:build", True), ("mod:build", True), ("configs/llama.json", False),
     ("C:/models/config.json", False), ("mod:", False), ("a-b:build", False)],
)  # fmt: skip
def test_what_reads_as_a_factory(spec, factory):
    assert is_factory(spec) is factory


@pytest.fixture
def module(monkeypatch):
    mod = types.ModuleType("attnchecker_test_factory")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_the_default_loss_is_next_token_cross_entropy_and_a_given_loss_is_used(module):
    module.plain = lambda vocab_size, seq_len: nn.Embedding(vocab_size, vocab_size)
    module.paired = lambda vocab_size, seq_len: (
        nn.Embedding(vocab_size, vocab_size), lambda logits, labels: logits.sum() * 0 + 7.0
    )  # fmt: skip
    ids = torch.randint(0, 10, (2, 5))
    own = load_factory(f"{module.__name__}:plain", vocab_size=10, seq_len=5, seed=0)
    assert isinstance(own, OwnModel)
    out = own(input_ids=ids, labels=ids)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.equal(out.loss, want)
    paired = load_factory(f"{module.__name__}:paired", vocab_size=10, seq_len=5, seed=0)
    assert float(paired(input_ids=ids, labels=ids).loss.detach()) == 7.0
    assert own(input_ids=ids).loss is None


def test_a_factory_that_returns_no_module_is_refused(module):
    module.bad = lambda vocab_size, seq_len: "a model"
    with pytest.raises(ConfigError, match=r"returned str, not a torch\.nn\.Module"):
        load_factory(f"{module.__name__}:bad", vocab_size=10, seq_len=5, seed=0)
    with pytest.raises(ConfigError, match="cannot load"):
        load_factory("attnchecker_no_such_module:build", vocab_size=10, seq_len=5, seed=0)
