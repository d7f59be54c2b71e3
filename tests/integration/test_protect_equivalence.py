"""Protection changes nothing on clean data: same outputs, gradients and state dict, and
unprotect_ restores the model exactly."""

from __future__ import annotations

import pytest
import torch

from attnchecker import ABFTConfig, protect_, unprotect_
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import build

from .helpers import attention_layers, batch, max_diff, models, train_step


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_is_bitwise_unchanged(family):
    protected, plain = models(family)
    inputs = batch(family)
    handle = protect_(protected)
    got = train_step(protected, inputs)
    want = train_step(plain, inputs)
    assert torch.equal(got[0], want[0])
    assert max_diff(got[1], want[1]) == 0.0
    assert max_diff(got[2], want[2]) == 0.0
    assert handle.drain() == []
    assert all(c["detected"] == 0 for c in handle.counters().values())


@pytest.mark.parametrize("family", FAMILIES)
def test_no_grad_inference_is_unchanged(family):
    protected, plain = models(family)
    protected.eval(), plain.eval()
    inputs = {k: v for k, v in batch(family).items() if k != "labels"}
    protect_(protected)
    with torch.no_grad():
        assert torch.equal(protected(**inputs).logits, plain(**inputs).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_unchanged_and_unprotect_restores(family):
    model = build(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    handle = protect_(model)
    assert list(model.state_dict()) == list(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert len(handle.modules) == len(attention_layers(model))
    unprotect_(model)
    assert model.config._attn_implementation == impl
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not any(k.startswith("_attnchecker") for k in vars(m))
    protect_(model)  # and it can be protected again


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_selected_layers_only(family):
    model = build(family)
    handle = protect_(model, ABFTConfig(layers=(1,)))
    assert [handle.state(n).layer for n in handle.modules] == [1]
    out = model(**batch(family))
    assert torch.isfinite(out.loss)


def test_classification_heads_work():
    for family in ("bert", "gpt2"):
        model = build(family, task="cls")
        protect_(model)
        inputs = batch(family)
        inputs["labels"] = torch.tensor([0, 1])
        assert torch.isfinite(model(**inputs).loss)


@pytest.mark.parametrize(
    "options",
    [
        {"scale_attn_by_inverse_layer_idx": True},
        {"reorder_and_upcast_attn": True},
        {"scale_attn_weights": False},
    ],
)
def test_gpt2_scale_options(options):
    """GPT-2's scaling options, including the fp32 reordered path, are reproduced exactly, and a
    fault under them is still corrected."""
    protected, plain = models("gpt2", **options)
    inputs = batch("gpt2")
    handle = protect_(protected)
    got, want = train_step(protected, inputs), train_step(plain, inputs)
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0

    faulty, ref = models("gpt2", **options)
    h = protect_(faulty)
    h.attach(
        lambda c: (
            c.tensor[1, 2, 4, 1].fill_(float("nan"))
            if c.site == "scores" and c.layer == 1
            else None
        )
    )
    got, want = train_step(faulty, inputs), train_step(ref, inputs)
    assert torch.allclose(got[0], want[0], rtol=1e-6) and max_diff(got[1], want[1]) <= 1e-5
    assert [e.action for e in h.drain()] == ["corrected"]
    assert handle.drain() == []
