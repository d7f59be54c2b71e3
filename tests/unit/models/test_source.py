"""The model a command names (models.source): a family, a transformers config file or a
factory, each built the same way; the copy as its user runs it; and the errors for a name that
is none of them."""

import json

import pytest
import torch

from attnchecker.errors import ConfigError
from attnchecker.models.factory import OwnModel
from attnchecker.models.source import example, kind_of, make, plain, tag


def _config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 32000, "max_position_embeddings": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_each_kind_of_name_builds_a_training_model_without_a_cache(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(".")
    names = {"family": "gpt2", "config": _config(tmp_path),
             "factory": "tests.integration.sdpa_models:nanogpt"}  # fmt: skip
    for kind, name in names.items():
        assert kind_of(name) == kind
        model = make(name, seed=3)
        assert model.training
        ids = torch.randint(3, 128, (2, 16))
        assert model(input_ids=ids, labels=ids).logits.shape[-1] == 128  # the campaigns' vocab
        again = make(name, seed=3)  # the seed decides the weights
        for a, b in zip(model.parameters(), again.parameters(), strict=True):
            assert torch.equal(a, b)
        if kind != "factory":
            assert model.config.use_cache is False
    assert make(names["config"], vocab_size=300).get_input_embeddings().num_embeddings == 300


def test_the_plain_copy_is_the_model_as_its_user_runs_it(monkeypatch):
    monkeypatch.syspath_prepend(".")
    gpt2, neo = make("gpt2"), make("gpt_neo")  # GPT-Neo has no SDPA path in transformers
    assert plain(gpt2).config._attn_implementation == "sdpa"
    assert gpt2.config._attn_implementation == "eager"  # the original is left as it was
    assert plain(neo).config._attn_implementation == "eager"
    own = make("tests.integration.sdpa_models:nanogpt")
    ids = torch.randint(3, 128, (2, 16))
    assert torch.equal(plain(own)(input_ids=ids).logits, own(input_ids=ids).logits)
    assert isinstance(own, OwnModel) and example(own, ids)[0].shape == (1, 16)
    assert example(gpt2, ids) is None  # found by the family table, no trace


def test_names_that_are_no_model_are_refused_by_what_they_are_not(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown model 'gtp2'.*gpt2.*config\.json.*factory"):
        make("gtp2")
    with pytest.raises(ConfigError, match="cannot read a transformers config"):
        make(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="trains task 'lm'"):
        make("tests.integration.sdpa_models:nanogpt", task="cls")


def test_a_tag_is_a_file_name_part():
    assert tag("gpt2") == "gpt2"
    assert tag("pkg.models:nano") == "pkg.models_nano"
    assert tag("/runs/cfg/config.json") == "runs_cfg_config.json"
