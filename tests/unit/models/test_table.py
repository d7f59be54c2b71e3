"""models.families.TABLE entry by entry, and models.tiny: configs at every size, builds, seeds,
the classification task and the user's own config file (``from_file``)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from attnchecker.errors import ConfigError
from attnchecker.models.families import FAMILIES, TABLE, Family, Wiring
from attnchecker.models.tiny import SIZES, build, family_config, from_file

# what a site string of a Wiring path holds (the docstring of Wiring)
SITE_EXPANSION = {"q": ("q",), "k": ("k",), "v": ("v",), "kv": ("k", "v"),
                  "qkv": ("q", "k", "v"), "out": ("out",)}  # fmt: skip
HEADS = ("causal", "masked", "seq2seq")


def _sites(paths: tuple[str, ...]) -> list[str]:
    out = []
    for p in paths:
        path, sep, sites = p.partition(":")
        assert sep and path and sites in SITE_EXPANSION, p
        out += SITE_EXPANSION[sites]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_entry_is_well_formed(family):
    fam = TABLE[family]
    assert isinstance(fam, Family) and isinstance(fam.wiring, Wiring)
    assert isinstance(getattr(tf, fam.config)(), tf.PretrainedConfig), fam.config
    assert getattr(tf, fam.config).model_type == family  # the table is keyed by model_type
    # every site once, Q, K, V and the output projection each exactly once
    assert sorted(_sites(fam.wiring.projections)) == ["k", "out", "q", "v"], family
    if fam.wiring.cross:
        assert sorted(_sites(fam.wiring.cross)) == ["k", "out", "q", "v"], family
    assert set(fam.wiring.read_early) <= {"q", "k"}
    assert fam.head in HEADS and fam.generates == (fam.head != "masked")
    attn, mlp = fam.sublayers
    assert attn and mlp and attn != mlp
    assert len(set(fam.keys)) == 4 and fam.positions_extra >= 0
    assert all(0 <= v < 128 for v in fam.ids.values())  # inside the tiny vocabulary
    if fam.wiring.patch is not None:  # a family outside AttentionInterface: a method + factory
        method, factory = fam.wiring.patch
        assert method.isidentifier() and callable(factory)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_at_every_size_has_the_shape_its_keys_name(family, size):
    fam = TABLE[family]
    k_hidden, k_layers, k_heads, k_positions = fam.keys
    cfg = family_config(family, size, layers=3, vocab_size=100, max_len=48)
    assert cfg.model_type == family and cfg.vocab_size == 100
    hidden, heads = getattr(cfg, k_hidden), getattr(cfg, k_heads)
    assert getattr(cfg, k_layers) == 3 and hidden % heads == 0
    assert getattr(cfg, k_positions) == 48 + fam.positions_extra
    for k, v in fam.ids.items():
        assert getattr(cfg, k) == v
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # none beyond the vocabulary
        v = getattr(cfg, k, None)
        assert v is None or not isinstance(v, int) or v < 100, (k, v)
    if size == "base":
        assert hidden == 768  # as the docstring says


def test_sizes_grow_and_overrides_are_set():
    hidden = [family_config("llama", s).hidden_size for s in SIZES]
    assert hidden == sorted(hidden) and len(set(hidden)) == len(SIZES)
    assert family_config("llama", layers=5).num_hidden_layers == 5
    assert family_config("gpt2", attn_pdrop=0.25).attn_pdrop == 0.25


def test_build_is_seeded_and_takes_the_family_head():
    a, b, c = build("llama", seed=3), build("llama", seed=3), build("llama", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert type(a).__name__ == "LlamaForCausalLM"
    assert type(build("bert")).__name__ == "BertForMaskedLM"
    assert type(build("bart")).__name__ == "BartForConditionalGeneration"
    assert a.config._attn_implementation == "eager"  # the math the checked core reproduces


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_the_classification_task_has_two_labels(family):
    model = build(family, task="cls")
    assert model.config.num_labels == 2
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=torch.tensor([0, 1]))
    assert out.logits.shape == (2, 2) and torch.isfinite(out.loss)


def test_an_unknown_task_is_refused():
    with pytest.raises(ValueError, match="task must be 'lm' or 'cls'"):
        build("gpt2", task="regression")


def test_from_file_builds_the_users_config(tmp_path):
    family_config("qwen2", vocab_size=96).to_json_file(str(tmp_path / "config.json"))
    by_dir, by_file = from_file(str(tmp_path)), from_file(str(tmp_path / "config.json"))
    assert type(by_dir).__name__ == "Qwen2ForCausalLM" and by_dir.config.vocab_size == 96
    assert all(torch.equal(v, by_file.state_dict()[k]) for k, v in by_dir.state_dict().items())
    # a smaller vocabulary (the tokenizer's) drops special ids beyond it
    raw = json.loads((tmp_path / "config.json").read_text()) | {"bos_token_id": 90}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    small = from_file(str(tmp_path), vocab_size=64)
    assert small.config.vocab_size == 64 and small.config.bos_token_id is None


def test_from_file_takes_transformers_head_for_a_type_outside_the_table(tmp_path):
    cfg = tf.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=4, intermediate_size=64)  # fmt: skip
    assert cfg.model_type not in TABLE
    cfg.to_json_file(str(tmp_path / "config.json"))
    assert type(from_file(str(tmp_path))).__name__ == "AlbertForMaskedLM"  # no causal LM


def test_from_file_refuses_what_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        from_file(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        from_file(str(tmp_path / "bad.json"))
    (tmp_path / "plain.json").write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(ConfigError, match="no model_type"):
        from_file(str(tmp_path / "plain.json"))
