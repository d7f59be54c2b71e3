"""``scope="all_linear"`` on a PyTorch model whose attention protect_ cannot check: a
nanoGPT-style GPT written here (no transformers config) whose attention is written by hand
(q @ k^T, softmax, @ v: no ``F.scaled_dot_product_attention`` to route) has every linear layer
checked, forward and backward, corrected in the same step; its attention is said to be
unchecked, never silently; the default scope refuses by name (at protect_ with example=, else
at the first forward, where the attention is seen running). (The same GPT with SDPA has its
attention checked: tests/integration/test_protect_sdpa.py.)"""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from attnchecker import ABFTConfig, protect_, unprotect_
from attnchecker.errors import ConfigError, UnsupportedModelError


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(C // self.heads)  # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        y = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v  # (B, nh, T, hd)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


def _step(model: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logits = model(idx)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


IDX = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def test_the_default_scope_refuses_a_model_it_cannot_find_attention_in():
    """Refused by what runs: at protect_ with example=, else at the first forward."""
    with pytest.raises(UnsupportedModelError, match=r"by hand .* h\.0, h\.1"):
        protect_(_gpt(), example=(IDX,))
    model = _gpt()
    protect_(model)
    with pytest.raises(UnsupportedModelError, match=r"by hand .* h\.0, h\.1"):
        model(IDX)


def test_all_linear_checks_every_linear_layer_and_says_attention_is_not():
    model = _gpt()
    want_loss, want_grads = _step(_gpt(), IDX)
    handle = protect_(model, ABFTConfig(scope="all_linear"))
    assert handle.pending and handle.modules == []
    with pytest.warns(RuntimeWarning, match=r"checks the 9 linear layer\(s\) of GPT, not its"):
        model(IDX)  # discovery at the first forward: its attention is by hand
    summary = handle.summary()
    assert "by hand" in summary["attention"]
    assert sorted(handle.modules) == sorted(
        n for n, m in model.named_modules() if isinstance(m, nn.Linear)
    )
    for _ in range(2):  # clean steps: the model's own math, no alarm
        loss, grads = _step(model, IDX)
        assert loss == want_loss
        assert handle.drain() == []
    hit = {"c_attn": ("y", "h.0.c_attn"), "fc": ("dw", "h.1.fc"), "head": ("dx", "lm_head")}

    def fault(call):
        call.tensor.view(-1)[5] = math.inf

    for site, module in hit.values():
        detach = handle.attach(fault, sites=(site,), modules=(module,))
        loss, grads = _step(model, IDX)
        detach.remove()
        assert loss == want_loss
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        events = handle.drain()
        assert [(e.module, e.op, e.action) for e in events] == [(module, site, "corrected")]
    unprotect_(model)
    assert not any(m._forward_hooks for m in model.modules())
    assert not any("forward" in vars(m) for m in model.modules())


def test_layers_or_a_schedule_without_attention_are_refused():
    with pytest.raises(ConfigError, match="finds none"):
        protect_(_gpt(), ABFTConfig(scope="all_linear", layers=(0,)), example=(IDX,))
    model = _gpt()
    protect_(model, ABFTConfig(scope="all_linear", layers=(0,)))
    with pytest.raises(ConfigError, match="finds none"):
        model(IDX)
