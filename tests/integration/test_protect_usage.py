"""protect_ as models are used beyond one training step: generate() with the KV cache,
cross-attention, modules it does not bind, and the keywords transformers passes."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from attnchecker import ABFTConfig, UnsupportedModelError, protect_
from attnchecker.models.families import TABLE
from attnchecker.models.interface import _attention
from attnchecker.models.tiny import build, family_config

from .helpers import KINDS, PATTERNS, SITES, batch, fault_matrix, max_diff, models, train_step

DECODERS = tuple(f for f, fam in TABLE.items() if fam.generates)
_GREEDY = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


def _prompt(B: int = 2, L: int = 9) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (B, L), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second prompt
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", DECODERS)
def test_generate_with_kv_cache_gives_the_eager_tokens(family):
    model = build(family).eval()
    plain = copy.deepcopy(model)
    handle = protect_(model)
    want = plain.generate(**_prompt(), **_GREEDY)
    got = model.generate(**_prompt(), **_GREEDY)
    assert torch.equal(got, want)
    assert handle.drain() == []
    assert handle.step == _GREEDY["max_new_tokens"]  # one forward per new token


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("site", ["k", "scores", "context"])
def test_a_fault_during_decoding_is_corrected(family, site):
    """A NaN at the third decoding step (one new token's row; K and V come from the cache)."""
    model = build(family).eval()
    want = copy.deepcopy(model).generate(**_prompt(), **_GREEDY)
    handle = protect_(model)
    fired = []

    def hook(c):  # the new token's row: (B, 1, N) projections, (B, H, 1, M) attention
        if c.site == site and c.layer == 0 and c.step == 3 and not fired:
            c.tensor[(1, -1) if c.tensor.dim() == 3 else (1, 1, -1)] = float("nan")
            fired.append(c.tensor.shape)

    handle.attach(hook)
    got = model.generate(**_prompt(), **_GREEDY)
    assert fired
    assert torch.equal(got, want)
    events = handle.drain()
    assert any(e.op == site and e.step == 3 and e.action == "corrected" for e in events), events


def _bert_decoder():
    cfg = family_config("bert", is_decoder=True, add_cross_attention=True)
    torch.manual_seed(0)
    return transformers.BertLMHeadModel._from_config(cfg, attn_implementation="eager").train()


def _gpt2_with_cross_attention():
    cfg = family_config("gpt2", add_cross_attention=True)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").train()


CROSS = {"bert": _bert_decoder, "gpt2": _gpt2_with_cross_attention}


def _cross_inputs(B: int = 2, L: int = 12, Le: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (B, L), generator=g)
    enc_mask = torch.ones(B, Le, dtype=torch.long)
    enc_mask[0, -2:] = 0
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "encoder_hidden_states": torch.randn(B, Le, 32, generator=g),
        "encoder_attention_mask": enc_mask,
    }


@pytest.mark.parametrize("family", sorted(CROSS))
def test_cross_attention_is_protected_and_exact(family):
    model = CROSS[family]()
    plain = copy.deepcopy(model)
    handle = protect_(model)
    cross = [n for n in handle.modules if "cross" in n]
    assert len(cross) == model.config.num_hidden_layers, handle.modules
    inputs = _cross_inputs()
    got, want = train_step(model, inputs), train_step(plain, inputs)
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0
    assert handle.drain() == []


@pytest.mark.parametrize("family", sorted(CROSS))
def test_faults_in_cross_attention_are_corrected(family):
    """Q from the decoder, K and V from the encoder states: every op, every pattern, the
    extreme kinds taking turns."""
    base = CROSS[family]()
    module = next(n for n in protect_(copy.deepcopy(base)).modules if "cross" in n)
    failures = fault_matrix(
        base, _cross_inputs(), train_step, module=module, layer=None,
        kinds=("inf", "nan", "1e10"), sites=SITES, patterns=PATTERNS, rotate=0,
    )  # fmt: skip
    assert not failures, failures[:5]


def test_faults_in_bart_cross_attention_are_corrected():
    """BART's decoder cross-attention (Q from the decoder, K and V from the encoder output,
    K|V projected by two Linear of one input): every op, every pattern."""
    base, _ = models("bart")
    module = "model.decoder.layers.0.encoder_attn"
    assert module in protect_(copy.deepcopy(base)).modules
    failures = fault_matrix(
        base, batch("bart"), train_step, module=module, layer=None,
        kinds=("inf", "nan", "1e10"), rotate=1,
    )  # fmt: skip
    assert not failures, failures[:5]


def test_unbound_modules_run_their_own_eager_math():
    """Layers not selected still reach the checked attention function: they must run exactly
    their family's eager attention (here layer 1 of two, and every BERT cross-attention)."""
    model = _bert_decoder()
    plain = copy.deepcopy(model)
    handle = protect_(model, ABFTConfig(layers=(0,)))
    assert all(".0." in n for n in handle.modules)
    inputs = _cross_inputs()
    got, want = train_step(model, inputs), train_step(plain, inputs)
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0


@pytest.mark.parametrize(("keyword", "value"), [("s_aux", torch.zeros(4)), ("new_option", 1.0)])
def test_keywords_that_change_the_math_are_refused_by_name(keyword, value):
    model = build("llama")
    protect_(model)
    attn = model.model.layers[0].self_attn
    q = k = v = torch.randn(1, 4, 5, 8)
    with pytest.raises(UnsupportedModelError, match=keyword):
        _attention(attn, q, k, v, None, scaling=0.3, **{keyword: value})
    out, _ = _attention(attn, q, k, v, None, scaling=0.3, sliding_window=None, position_ids=None)
    assert out.shape == (1, 5, 4, 8)


def test_sliding_window_through_the_mask_is_exact():
    """Mistral passes sliding_window to the attention function; the eager mask holds it."""
    cfg = family_config("llama", sliding_window=4)
    cfg.model_type = "mistral"
    mistral_cfg = transformers.MistralConfig(**cfg.to_dict())
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM._from_config(
        mistral_cfg, attn_implementation="eager"
    ).train()
    plain = copy.deepcopy(model)
    protect_(model)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    got, want = train_step(model, inputs), train_step(plain, inputs)
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0


def test_kind_table_is_shared():
    assert set(KINDS) >= {"inf", "nan", "1e10"}
