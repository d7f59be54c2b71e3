"""protect_ on a real library outside transformers: lucidrains' x-transformers (a dev
dependency), whose attention calls F.scaled_dot_product_attention with attn_flash=True inside
its own Attend module. Its projections are found by a traced forward (to_q, to_k, to_v,
to_out: heads of 64 over a width of 32), a fault in every GEMM of its attention, forward and
backward, is corrected in the same step, found with example= or at its first forward; its
default, attention by hand, is refused by name, at protect_ with example= and at the first forward
without (strict), or named with strict=False."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from attnchecker import protect_
from attnchecker.errors import UnsupportedModelError

x_transformers = pytest.importorskip("x_transformers")

VOCAB, T = 64, 16
IDX = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
SITES = ("q", "k", "v", "out", "scores", "probs", "context", "dq", "dk", "dp", "dv", "dx.q",
         "dw.q", "dx.out", "dw.out")  # fmt: skip


def _build(flash: bool = True):
    torch.manual_seed(0)
    layers = x_transformers.Decoder(dim=32, depth=2, heads=4, attn_flash=flash)
    return x_transformers.TransformerWrapper(num_tokens=VOCAB, max_seq_len=T, attn_layers=layers)


def _step(model):
    model.zero_grad()
    logits = model(IDX)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), IDX[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _inf(call) -> None:
    call.tensor[(0,) * (call.tensor.dim() - 1) + (5,)] = math.inf


@pytest.mark.parametrize("example", [True, False])
def test_every_attention_gemm_fault_is_corrected(example):
    """Its flash model, found with example= or at the first forward (which runs checked)."""
    want = _step(_build())
    model = _build()
    handle = protect_(model, example=(IDX,) if example else None)
    if not example:
        assert handle.pending and handle.modules == []
        close_first = _step(model)
        torch.testing.assert_close(close_first[0], want[0], rtol=1e-5, atol=1e-6)
    assert handle.modules == ["attn_layers.layers.0.1.attend", "attn_layers.layers.2.1.attend"]
    assert all(c["unchecked"] == {} for c in handle.summary()["per_module"].values())
    block = handle.modules[1]

    def close(got) -> None:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    close(_step(model))
    assert handle.drain() == []
    for site in SITES:
        detach = handle.attach(_inf, sites=(site,), modules=(block,))
        got = _step(model)
        detach.remove()
        close(got)
        assert [(e.op, e.action) for e in handle.drain()] == [(site, "corrected")], site


def test_its_default_attention_by_hand_is_refused_by_name_at_protect_or_at_the_first_forward():
    """Its default Attend computes attention by hand (its source has an SDPA branch that the
    default options do not take): example= refuses at protect_; without it, the first forward
    raises the same words (strict=True), and the model is left as it was."""
    with pytest.raises(UnsupportedModelError, match=r"by hand .*layers\.0\.1\.attend") as first:
        protect_(_build(flash=False), example=(IDX,))
    model = _build(flash=False)
    handle = protect_(model)
    assert set(handle.summary()["per_module"]) == {
        "attn_layers.layers.0.1.attend",
        "attn_layers.layers.2.1.attend",
    }  # fmt: skip  where its source says to look, pending
    with pytest.raises(UnsupportedModelError) as later:
        model(IDX)
    assert str(later.value) == str(first.value)
    assert handle.modules == [] and not any(m._forward_pre_hooks for m in model.modules())


def test_its_default_attention_by_hand_with_strict_false_is_named_and_its_linears_checked():
    """strict=False and scope="all_linear": the first forward warns naming the attend modules,
    which are not listed as protected; the linear layers are checked (a fault corrected)."""
    from attnchecker import ABFTConfig

    want = _step(_build(flash=False))
    model = _build(flash=False)
    handle = protect_(model, ABFTConfig(strict=False, scope="all_linear"))
    with pytest.warns(RuntimeWarning, match=r"not its attention: .*by hand .*layers\.0\.1\.attend"):
        _step(model)
    assert not any(n.endswith("attend") for n in handle.modules)
    assert "layers.2.1.attend" in handle.summary()["attention"]
    detach = handle.attach(_inf, sites=("y",), modules=("attn_layers.layers.0.1.to_q",))
    got = _step(model)
    detach.remove()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert [(e.op, e.action) for e in handle.drain()] == [("y", "corrected")]
