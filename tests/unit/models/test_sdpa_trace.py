"""How the traced forward reads a fused projection's layout (``models.sdpa_trace._layout``):
from V alone, compared bitwise with the projection's output, on outputs built here in each
layout (the integration tests run the look-alike models); and the probe that compares the
checked core's math with each recorded SDPA call."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from attnchecker.models.sdpa_trace import _layout, mha_split

B, L, D = 2, 5, 4  # batch, tokens, head size


def _heads(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(B, n, L, D, generator=g)  # (B, n, L, d)


def _flat(*parts: torch.Tensor) -> torch.Tensor:
    """Heads (B, n_i, L, d) laid out one after another as a projection's output (B, L, N)."""
    return torch.cat([p.transpose(1, 2).flatten(-2) for p in parts], -1)


@pytest.mark.parametrize(("nh", "n_kv"), [(4, 4), (4, 2), (4, 1), (6, 2)])
def test_contiguous_q_k_v(nh, n_kv):
    g = torch.Generator().manual_seed(nh * 10 + n_kv)
    q, k, v = _heads(nh, g), _heads(n_kv, g), _heads(n_kv, g)
    assert _layout(_flat(q, k, v), v, D, nh, "qkv") == (False, 0, 0)
    rep = v.repeat_interleave(nh // n_kv, 1)  # K / V repeated to the query heads by hand
    assert _layout(_flat(q, k, v), rep, D, nh, "qkv") == (False, 0, 0)


@pytest.mark.parametrize(("nh", "n_kv"), [(4, 4), (4, 2), (6, 3), (6, 2)])
def test_interleaved_per_kv_group(nh, n_kv):
    """[q heads of group g | k_g | v_g] per group: GPT-NeoX (one query head a group), Megatron."""
    g = torch.Generator().manual_seed(nh * 10 + n_kv)
    q, k, v = _heads(nh, g), _heads(n_kv, g), _heads(n_kv, g)
    r = nh // n_kv
    y = _flat(*(t for i in range(n_kv) for t in (q[:, i * r : (i + 1) * r], k[:, i : i + 1],
                                                  v[:, i : i + 1])))  # fmt: skip
    assert _layout(y, v, D, nh, "qkv") == (True, 0, 0)
    assert _layout(y, v.repeat_interleave(r, 1), D, nh, "qkv") == (True, 0, 0)


@pytest.mark.parametrize(("lead", "trail"), [(8, 0), (0, 3), (2, 5)])
def test_q_k_v_among_features_no_site_names(lead, trail):
    """timm's ParallelScalingBlock: [MLP input | Q | K | V]; PaLM-like [Q | K | V | MLP]."""
    g = torch.Generator().manual_seed(lead * 10 + trail)
    q, k, v = _heads(4, g), _heads(2, g), _heads(2, g)
    y = _flat(_heads(lead, g), q, k, v, _heads(trail, g))
    assert _layout(y, v, D, 4, "qkv") == (False, lead, trail)


def test_fused_k_v_and_what_is_not_found():
    g = torch.Generator().manual_seed(0)
    k, v = _heads(3, g), _heads(3, g)
    assert _layout(_flat(k, v), v, D, 4, "kv") == (False, 0, 0)
    assert _layout(_flat(*(t[:, i : i + 1] for i in range(3) for t in (k, v))), v, D, 4, "kv") == (
        True, 0, 0,
    )  # fmt: skip
    q = _heads(4, g)
    assert _layout(_flat(q, v, k), v, D, 4, "qkv") is None  # V in no place a layout puts it
    one_ulp = torch.nextafter(v, v + 1)
    assert _layout(_flat(q, k, v), one_ulp, D, 4, "qkv") is None  # bitwise, not close


def test_mha_split_follows_the_inputs_identity():
    x, m = torch.zeros(2), torch.zeros(2)
    assert mha_split(x, x, x) == ("qkv",)
    assert mha_split(x, m, m) == ("q", "kv")
    assert mha_split(x, m, m.clone()) == ("q", "k", "v")
    assert mha_split(x, x, x.clone()) == ("q", "k", "v")


def test_the_probe_compares_the_checked_cores_math_with_sdpa():
    """protect_(model, example=...) runs each recorded SDPA call through the checked core's
    math and refuses a module whose result is not SDPA's own within rounding: equal for causal,
    boolean and additive masks, a scale and GQA; a call read wrongly (here SDPA ran causal and
    the arguments say otherwise) differs and is named; dropout is random and not compared."""
    from attnchecker.models.sdpa import probe

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    kv2 = (k[:, :2], v[:, :2])
    keep = torch.rand(2, 1, 1, 8, generator=g) > 0.3
    keep[..., 0] = True
    bias = torch.randn(2, 1, 8, 8, generator=g)
    calls = {
        "causal": ((q, k, v), {"is_causal": True}),
        "bool mask": ((q, k, v), {"attn_mask": keep}),
        "float mask, scale": ((q, k, v), {"attn_mask": bias, "scale": 0.3}),
        "gqa": ((q, *kv2), {"enable_gqa": True, "is_causal": True}),
    }
    recorded = {n: (ops, kw, F.scaled_dot_product_attention(*ops, **kw))
                for n, (ops, kw) in calls.items()}  # fmt: skip
    assert probe(recorded) == []
    wrong = {"m": ((q, k, v), {"is_causal": False}, recorded["causal"][2])}
    assert probe(wrong)[0].startswith("m: the checked core's output differs from SDPA's")
    noisy = {"d": ((q, k, v), {"dropout_p": 0.5}, torch.zeros_like(q))}
    assert probe(noisy) == []


def test_the_probe_refuses_a_one_percent_scale_and_a_nan_only_difference():
    """Its tolerance is 64 units of rounding of the largest |v|: a scale read 1% off (a
    difference of ~1e-3, far above 64 ulps ~ 7.6e-6 here, far below 1e5 ulps ~ 1e-2) is
    refused, and so is an output with NaN where SDPA has none even if every finite value
    agrees."""
    from attnchecker.models.sdpa import PROBE_ULPS, probe

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert probe({"ok": ((q, k, v), {"scale": 0.25}, want)}) == []
    bad = probe({"m": ((q, k, v), {"scale": 0.25 * 1.01}, want)})
    assert len(bad) == 1 and bad[0].startswith("m: the checked core's output differs")
    worst = float(bad[0].split("by up to ")[1].split(" ")[0])
    tol = PROBE_ULPS * torch.finfo(torch.float32).eps * float(v.abs().max())
    assert tol < worst < 1e5 / PROBE_ULPS * tol  # refused at 64 ulps, not at 1e5
    nan = want.clone()
    nan[0, 0, 0, 0] = float("nan")  # SDPA's NaN where the core has a number
    assert "NaN where SDPA has none: 1" in probe({"n": ((q, k, v), {"scale": 0.25}, nan)})[0]


def test_protect_refuses_a_module_the_probe_refuses_with_or_without_an_example():
    """A boolean mask that leaves a query row no key: SDPA gives that row NaN, the checked core
    uniform probabilities. The probe sees it on the traced call and protect_ refuses, at
    protect_ with example=, else at the first forward (the probe runs on that forward's trace)."""
    from attnchecker import protect_
    from attnchecker.errors import UnsupportedModelError

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            keep = torch.ones(8, 8, dtype=torch.bool)
            keep[3] = False  # query 3 attends to nothing
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    x = torch.randn(2, 8, 16)
    model = torch.nn.Sequential(Masked())
    with pytest.raises(UnsupportedModelError, match=r"0: the checked core's output differs.*NaN"):
        protect_(model, example=(x,))
    protect_(model)
    with pytest.raises(UnsupportedModelError, match=r"0: the checked core's output differs.*NaN"):
        model(x)
