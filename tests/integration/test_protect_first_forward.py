"""A model of one's own protected without example= (attnchecker.models.pending): what protect_
finds at the first forward, and what ``summary()["per_module"][m]["unchecked"]`` says of every
op the config asks for and a module does not check, for each reason: discovery pending, no
linear layer making Q / K / V, a fused layout not understood, a backward not reachable, a
fused GEMM named by an op the config leaves out, no output projection. The first drain logs
one warning per module with unchecked ops. The traced forward leaves no trace: the first
protected step draws the same dropout masks and moves the buffers once, as the plain step."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from attnchecker import ABFTConfig, protect_
from attnchecker.models.handle import PENDING

from .helpers import lm_step
from .sdpa_models import HEADS, LM, VOCAB, NanoGPTAttention, T, build

IDX = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
D = 32


def _step(model):
    return lm_step(model, IDX)


class _Functional(nn.Module):
    """Q, K and V made by F.linear on Parameters (no nn.Linear): no projection to find."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3 * D, D) / D**0.5)
        self.o = nn.Linear(D, D)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = F.linear(x, self.w).view(B, L, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, L, D))


class _Swapped(nn.Module):
    """One fused projection laid out [K | V | Q]: a layout the checks do not implement."""

    def __init__(self) -> None:
        super().__init__()
        self.kvq, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, L, _ = x.shape
        kvq = self.kvq(x).split(D, -1)
        k, v, q = (t.view(B, L, HEADS, D // HEADS).transpose(1, 2) for t in kvq)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, L, D))


class _Frozen(NanoGPTAttention):
    """nanoGPT's attention whose Q|K|V weight does not require gradients (a frozen base)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn.requires_grad_(False)


class _LoRA(NanoGPTAttention):
    """A low-rank adapter on a frozen Q|K|V: the projection's output is two GEMMs' sum."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn.requires_grad_(False)
        self.lora_a, self.lora_b = nn.Linear(D, 4, bias=False), nn.Linear(4, 3 * D, bias=False)

    def forward(self, x):
        B, L, C = x.shape
        qkv = self.c_attn(x) + self.lora_b(self.lora_a(x))
        q, k, v = (t.view(B, L, HEADS, C // HEADS).transpose(1, 2) for t in qkv.split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, L, C))


class _OwnForward(nn.Linear):
    """A Linear subclass with a forward of its own (as quantized layers have)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def test_before_the_first_forward_every_configured_op_is_pending():
    model = build("nanogpt")
    handle = protect_(model, ABFTConfig(ops=("q", "scores", "dq")))
    summary = handle.summary()
    assert handle.pending and handle.modules == [] and summary["attention"] == PENDING
    assert summary["per_module"]["h.0.attn"]["unchecked"] == dict.fromkeys(
        ("q", "scores", "dq"), PENDING
    )
    with pytest.raises(Exception, match="first forward"):
        handle.attach(lambda c: None, sites=("q",))
    assert handle.drain() == []  # nothing ran, nothing found
    model(IDX)
    assert not handle.pending
    assert handle.summary()["per_module"]["h.0.attn"]["checked"] == ["q", "scores", "dq"]


@pytest.mark.parametrize(
    ("attention", "ops", "reason"),
    [
        (_Functional, ("q", "k", "v", "dx.q", "dw.q"), "no nn.Linear makes Q, K, V (h.0.attn.w"),
        (_Frozen, ("q", "k", "v", "dx.q", "dw.q"), "a weight that does not require gradients"),
        (_LoRA, ("q", "k", "v", "dx.q", "dw.q"), "Q by ['h.0.attn.lora_b'] and ['a weight th"),
        (_Swapped, ("q", "k", "v", "dx.q", "dw.q"), "outputs split into qkv in no known layout"),
    ],
)
def test_projections_not_found_are_named_with_the_reason(attention, ops, reason):
    torch.manual_seed(0)
    model = LM(attention)
    handle = protect_(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(IDX)
    layout = [w for w in seen if "not checked as attention projections" in str(w.message)]
    assert len(layout) == 2 and reason.replace("h.0", "h.1") in str(layout[1].message)
    cov = handle.summary()["per_module"]["h.0.attn"]
    asked = {o for o in cov["unchecked"] if not o.endswith("out")}
    assert asked == {"q", "k", "v", "dx.q", "dw.q", "dx.k", "dw.k", "dx.v", "dw.v"} >= set(ops)
    assert all(reason in cov["unchecked"][o] for o in ops), cov["unchecked"]
    assert {"scores", "dq"} <= set(cov["checked"]) and not set(ops) & set(cov["checked"])


def test_a_projection_with_a_forward_of_its_own_has_its_backward_named():
    torch.manual_seed(0)
    model = build("nanogpt")
    old = model.h[0].attn.c_attn
    model.h[0].attn.c_attn = _OwnForward(D, 3 * D)
    model.h[0].attn.c_attn.load_state_dict(old.state_dict())
    handle = protect_(model)
    with pytest.warns(RuntimeWarning, match=r"h\.0\.attn\.c_attn"):
        model(IDX)
    cov = handle.summary()["per_module"]
    assert list(cov["h.0.attn"]["unchecked"]) == ["dx.q", "dw.q"]
    assert "_OwnForward has a forward of its own" in cov["h.0.attn"]["unchecked"]["dx.q"]
    assert {"q", "k", "v"} <= set(cov["h.0.attn"]["checked"])
    assert cov["h.1.attn"]["unchecked"] == {}


def test_a_fused_gemm_asked_by_an_op_the_config_leaves_out_is_named():
    """dx.k alone on a fused Q|K|V: its GEMM is dx.q's, which the config does not check."""
    model = build("nanogpt")
    handle = protect_(model, ABFTConfig(ops=("dx.k", "scores")))
    model(IDX)
    cov = handle.summary()["per_module"]["h.0.attn"]
    assert cov["checked"] == ["scores"]
    assert cov["unchecked"] == {"dx.k": "one GEMM with dx.q (a fused projection), which the "
                                         "config does not check"}  # fmt: skip


def test_the_first_drain_logs_one_warning_per_module_with_unchecked_ops(caplog):
    torch.manual_seed(0)
    model = LM(_Functional)
    handle = protect_(model)
    with caplog.at_level(logging.WARNING, logger="attnchecker"):
        _step(model)
        handle.drain()
        handle.drain()
    lines = [r.getMessage() for r in caplog.records if "does not check" in r.getMessage()]
    assert [line.split()[1] for line in lines] == ["h.0.attn", "h.1.attn"]
    assert "q (projections not found: no nn.Linear makes Q, K, V" in lines[0]


class _Noisy(nn.Module):
    """nanoGPT's attention with attention dropout, a dropout on its output, and a buffer the
    forward moves (a running count, as a BatchNorm's statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = NanoGPTAttention()
        self.drop = nn.Dropout(0.2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        B, L, C = x.shape
        q, k, v = self.inner.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, L, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.drop(self.inner.c_proj(y.transpose(1, 2).reshape(B, L, C)))


def test_the_traced_forward_leaves_the_random_state_and_the_buffers_as_they_were():
    """The first protected step (discovery's traced forward, then the checked one) equals the
    plain step under the same seed: the same dropout masks, each buffer moved once."""
    torch.manual_seed(0)
    plain = LM(_Noisy)
    torch.manual_seed(0)
    model = LM(_Noisy)
    torch.manual_seed(5)
    want = _step(plain)
    handle = protect_(model)
    torch.manual_seed(5)
    got = _step(model)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [float(b) for b in model.buffers()] == [1.0, 1.0]
    assert handle.modules == ["h.0.attn", "h.1.attn"]
    assert handle.summary()["per_module"]["h.0.attn"]["unchecked"] == {}


def test_a_first_forward_under_inference_mode_still_finds_the_projections():
    model = build("nanogpt")
    handle = protect_(model)
    with torch.inference_mode():
        model(IDX)
    assert handle.summary()["per_module"]["h.0.attn"]["unchecked"] == {}
    want = _step(build("nanogpt"))

    def inf(call):
        call.tensor[(0,) * (call.tensor.dim() - 1) + (5,)] = math.inf

    detach = handle.attach(inf, sites=("dw.q",), modules=("h.0.attn",))
    got = _step(model)
    detach.remove()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert [(e.op, e.action) for e in handle.drain()] == [("dw.q", "corrected")]


def test_a_first_forward_inside_a_cuda_graph_capture_is_refused_saying_to_pass_an_example(
    monkeypatch,
):
    """No traced forward can run while a CUDA graph is being captured. There is no GPU here:
    the capture is what torch.cuda reports (patched), the refusal is the real code's."""
    model = build("nanogpt")
    protect_(model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(Exception, match=r"CUDA graph capture.*pass example=\(batch,\)"):
        model(IDX)
    monkeypatch.undo()
    assert not hasattr(model, "_attnchecker_handle")  # as it was
