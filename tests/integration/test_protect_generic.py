"""The generic rule: model types that are not in the family table are protected exactly, or
refused by name.

Accepted models must train bitwise as their eager attention does and have faults corrected at
every checked op; refused ones must say which module and what was not understood.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn

from attnchecker import ABFTConfig, UnsupportedModelError, protect_
from attnchecker.models.families import TABLE
from attnchecker.models.registry import discover
from attnchecker.models.tiny import _instantiate

from .helpers import SITES, fault_matrix, max_diff, train_step

ACCEPTED = ("gemma", "starcoder2", "granite", "cohere", "persimmon", "mbart", "electra")
REFUSED = {  # model_type: what the message names
    "bloom": "BloomAttention.*AttentionInterface",
    "gptj": "eager attention of GPTJAttention.*differs",
    "t5": "'t5'.*no.*known attention layout",
    "roformer": "RoFormerSelfAttention",
}


def generic_model(model_type: str) -> nn.Module:
    """A tiny randomly initialised LM of a transformers model type, with the common config keys
    (hidden 32, 2 layers, 4 heads, 2 K/V heads where it has them)."""
    cfg = tf.CONFIG_MAPPING[model_type](
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    small = {"num_key_value_heads": 2, "head_dim": 8, "d_model": 32, "encoder_layers": 2,
             "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
             "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}  # fmt: skip
    for k, v in small.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) >= 128:
            setattr(cfg, k, 1)
    head = "seq2seq" if cfg.is_encoder_decoder else "causal"
    if head == "causal" and type(cfg) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        head = "masked"
    model = _instantiate(cfg, head=head, task="lm", seed=0)
    model.train()
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


@pytest.mark.parametrize("model_type", ACCEPTED)
def test_generic_model_is_protected_exactly(model_type):
    assert model_type not in TABLE
    base = generic_model(model_type)
    found = discover(base)
    assert found.generic and found.blocks
    # nothing is known about what reads Q and K before V: each is checked as it is projected,
    # and V's sums are never handed across the module
    assert all(p.last for b in found.blocks for p in b.projections)
    assert not any(b.passing for b in found.blocks)
    model = copy.deepcopy(base)
    handle = protect_(model)
    got, want = train_step(model, _batch()), train_step(copy.deepcopy(base), _batch())
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0
    assert handle.drain() == []
    # every checked op, two kinds x two patterns
    failures = fault_matrix(
        base, _batch(), train_step, sites=SITES, kinds=("nan", "1e10"), patterns=("0D", "1R")
    )
    assert not failures, failures[:3]


@pytest.mark.parametrize(("model_type", "why"), REFUSED.items())
def test_generic_rule_refuses_by_name(model_type, why):
    model = generic_model(model_type)
    with pytest.raises(UnsupportedModelError, match=why):
        protect_(model, ABFTConfig())
    assert model.config._attn_implementation == "eager"  # nothing was installed


def test_table_entry_is_verified_against_transformers(monkeypatch):
    """A table entry whose spec no longer reproduces the family's eager attention (here: a
    transformers change simulated by patching Llama's eager function) is refused."""
    import transformers.models.llama.modeling_llama as llama

    model = generic_model("llama")
    real = llama.eager_attention_forward

    def changed(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        return real(module, query, key, value, attention_mask, scaling * 1.0001, dropout, **kw)

    monkeypatch.setattr(llama, "eager_attention_forward", changed)
    with pytest.raises(UnsupportedModelError, match=r"no longer matches.*'llama'"):
        protect_(model)
