"""protect_ on torchtitan's own Llama 3 (a dev dependency, torchtitan 0.2.2), the model its
trainer builds: wq / wk / wv / wo, RoPE, K and V repeated to the query heads by hand, SDPA inside
its ScaledDotProductAttentionWrapper. Its ``Transformer`` class has a method that builds flex
attention masks, so its source names ``flex_attention``; what runs decides: with its default
``attn_type="sdpa"`` it is protected, with or without example=, its summary true, a fault in
every GEMM of its attention corrected; with ``attn_type="flex"`` it is refused, naming where flex
attention ran, at protect_ with example= and at the first forward without."""

from __future__ import annotations

import math

import pytest
import torch

from attnchecker import protect_
from attnchecker.errors import UnsupportedModelError
from attnchecker.models.sdpa_trace import source_names

from .helpers import lm_step

model_module = pytest.importorskip("torchtitan.models.llama3.model.model")
args_module = pytest.importorskip("torchtitan.models.llama3.model.args")

VOCAB, T = 128, 16
IDX = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
SITES = ("q", "k", "v", "out", "scores", "probs", "context", "dq", "dk", "dp", "dv", "dx.q",
         "dw.q", "dx.k", "dw.k", "dx.v", "dw.v", "dx.out", "dw.out")  # fmt: skip
TOL = {"rtol": 1e-5, "atol": 1e-6}  # the eager core against SDPA's CPU kernel, fp32


def _build(attn_type: str = "sdpa"):
    args = args_module.TransformerModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32,
        attn_type=attn_type,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_module.Transformer(args)
    with torch.no_grad():  # as torchtitan's trainer initialises it
        model.init_weights()
    return model


def _step(model):
    return lm_step(model, IDX)


def _close(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], **TOL)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _inf(call) -> None:
    call.tensor[(0,) * (call.tensor.dim() - 1) + (5,)] = math.inf


def test_its_source_names_flex_attention():
    """The premise: the class's source names flex attention (a mask builder), and that alone
    used to refuse it."""
    model = _build()
    assert "flex_attention" in source_names(model)
    assert hasattr(type(model), "_get_flex_attention_masks")


@pytest.mark.parametrize("example", [False, True])
def test_its_sdpa_attention_is_protected_and_every_gemm_fault_corrected(example):
    want = _step(_build())
    model = _build()
    handle = protect_(model, example=(IDX,) if example else None)
    assert handle.pending is not example
    _close(_step(model), want)
    names = ["layers.0.attention.inner_attention", "layers.1.attention.inner_attention"]
    assert handle.modules == names
    summary = handle.summary()
    assert summary["attention"] is None
    assert set(summary["per_module"][names[1]]["checked"]) == set(SITES)
    assert summary["per_module"][names[1]]["unchecked"] == {}
    assert handle.drain() == []
    for site in SITES if example else ("q", "dw.v", "scores", "dq", "dx.out"):
        detach = handle.attach(_inf, sites=(site,), modules=(names[1],))
        got = _step(model)
        detach.remove()
        _close(got, want)
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")], site


def test_its_flex_attention_is_refused_where_it_runs():
    """attn_type="flex": flex attention runs (and, on a CPU, fails in its backward's check:
    the traced forward stops there), so it is refused naming the module it ran in."""
    model = _build("flex")
    masks = model.get_attention_masks(IDX, tokenizer=None)
    where = r"layers\.0\.attention\.inner_attention \(flex_attention\)"
    with pytest.raises(UnsupportedModelError, match=where):
        protect_(model, example=(IDX, masks))
    protect_(model)
    with pytest.raises(UnsupportedModelError, match=where):
        model(IDX, attention_masks=masks)
