"""What protection says it checks is what it checks (issue 21): a Linear with a forward of its
own keeps its forward checks but not its backward ones, and says so; every module names the
engine that runs it and the fallbacks it took."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from attnchecker import ABFTConfig, protect_
from attnchecker.kernels import available

from .helpers import batch, models


def _accelerate_like(module: nn.Module) -> None:
    """Replace ``module.forward`` with a wrapper, as accelerate's hooks do."""
    old = module.forward

    def forward(*args, **kwargs):
        return old(*args, **kwargs)

    module.forward = forward


class _Scaled(nn.Linear):
    """A Linear subclass with a forward of its own (as quantized layers have)."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


def test_a_patched_projection_is_named_and_not_listed_as_checked():
    model, _ = models("llama")
    attn = model.model.layers[0].self_attn
    _accelerate_like(attn.q_proj)
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.0\.self_attn\.q_proj"):
        handle = protect_(model)
    cov = handle.summary()["per_module"]
    name = "model.layers.0.self_attn"
    assert {"dx.q", "dw.q"} <= set(cov[name]["unchecked"])
    assert "dx.q" not in cov[name]["checked"] and "dx.k" in cov[name]["checked"]
    assert "q" in cov[name]["checked"]  # its output is still checked by a forward hook
    other = cov["model.layers.1.self_attn"]
    assert other["unchecked"] == {} and {"dx.q", "dq", "scores"} <= set(other["checked"])
    assert all(w.startswith("backward not reachable") for w in cov[name]["unchecked"].values())


def test_a_linear_subclass_under_all_linear_is_named():
    model, _ = models("llama")
    mlp = model.model.layers[0].mlp
    old = mlp.up_proj
    mlp.up_proj = _Scaled(old.in_features, old.out_features, bias=old.bias is not None)
    mlp.up_proj.load_state_dict(old.state_dict())
    with pytest.warns(RuntimeWarning, match=r"mlp\.up_proj"):
        handle = protect_(model, ABFTConfig(scope="all_linear"))
    cov = handle.summary()["per_module"]["model.layers.0.mlp.up_proj"]
    assert cov["checked"] == ["y"] and list(cov["unchecked"]) == ["dx", "dw"]
    assert "_Scaled has a forward of its own" in cov["unchecked"]["dx"]
    assert handle.summary()["per_module"]["model.layers.0.mlp.down_proj"]["checked"] == [
        "y", "dx", "dw",
    ]  # fmt: skip
    model(**batch("llama")).loss.backward()
    assert handle.drain() == []


def test_the_engine_of_every_module_is_said(caplog):
    """backend="auto" on a CPU runs the eager engine: summary() says so and why, and so does
    the first drain's log line."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(backend="auto"))
    cov = handle.summary()["per_module"]
    assert {c["engine"] for c in cov.values()} == {"eager"}
    assert all("protect it after moving it to CUDA" in c["note"] for c in cov.values())
    with caplog.at_level(logging.INFO, logger="attnchecker"):
        model(**batch("llama")).loss.backward()
        handle.drain()
        handle.drain()
    lines = [r.getMessage() for r in caplog.records if "engine" in r.getMessage()]
    assert len(lines) == 1 and "engine eager for 2 module(s)" in lines[0]
    assert "cpu at protect_" in lines[0]


@pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")
def test_a_fused_fallback_is_in_the_summary(caplog):
    """Attention dropout in training: the fused kernels never run; summary() says it, not only
    a warning once per process."""
    model, _ = models("llama", layers=1)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    handle = protect_(model, ABFTConfig(backend="triton"))
    cov = handle.summary()["per_module"]["model.layers.0.self_attn"]
    assert cov["engine"] == "triton" and cov["fallbacks"] == []
    with caplog.at_level(logging.INFO, logger="attnchecker"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-process warning may have been given
        torch.manual_seed(0)
        model(**batch("llama")).loss.backward()
        handle.drain()
    cov = handle.summary()["per_module"]["model.layers.0.self_attn"]
    assert cov["fallbacks"] == ["attention dropout in training"]
    assert any("fell back" in r.getMessage() for r in caplog.records)


def test_projections_of_unbatched_tokens_are_checked():
    """Projections called on (T, K) tokens (no batch dimension) are checked as tokens; they
    used to be skipped without a word."""
    model, _ = models("llama")
    handle = protect_(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(10, model.config.hidden_size)

    def fault(c):
        c.tensor[3, 5] = float("inf")

    detach = handle.attach(fault, sites=["v"], modules=["model.layers.0.self_attn"])
    with torch.no_grad():
        want = nn.functional.linear(x, attn.v_proj.weight, attn.v_proj.bias)
        attn.q_proj(x), attn.k_proj(x)
        got = attn.v_proj(x)
    detach.remove()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)  # the row recomputed alone
    events = handle.drain()
    assert [(e.op, e.action) for e in events] == [("v", "corrected")]


def test_a_record_with_column_flags_alone_keeps_lost():
    """A check that flags columns only and could not repair them is still reported."""
    from attnchecker.attention.state import AttentionState, Clock, new_log

    clock = Clock(torch.zeros(1, dtype=torch.float64))
    st = AttentionState("m", 0, ABFTConfig(), clock, new_log(torch.device("cpu")))
    st.note(("q",), torch.tensor([[0.0, 1.0, 5.0, 1.0, 0.0]]))
    st.commit()
    row = st.log[0].tolist()
    assert row[:6] == [0.0, 1.0, 5.0, 1.0, 0.0, 1.0]  # n_rows, n_cols, value, lost, -, detected
