"""The checks protected attention runs (``attention/checks.py``, ``attention/heads.py``), alone.

1. Clean inputs are never flagged and are left bit-for-bit unchanged: projections (nn.Linear and
   GPT-2's Conv1D, with and without bias, one site, a fused Q|K|V, separate Q, K and V of one
   input), scores, softmax probabilities and context, in fp32, bf16, fp16 and under CPU bf16
   autocast, over magnitudes 1e-3 .. 1e4 and data with outlier features.
2. Every fault kind at every pattern is repaired or reported (``lost``), never mis-corrected;
   inside the repair budget it is repaired.

The projection checks are called as :meth:`AttentionState._check_group` calls them (the factor
from :func:`row_factor`, the floor ``row_floor / factor`` in the weight sums), inside the
caller's autocast, as the forward hook runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn import functional as F

from attnchecker.abft.tolerance import magnitude_factor, unit_roundoff
from attnchecker.attention.checks import Projection, projection_check_, row_limits
from attnchecker.attention.handoff import Handoff
from attnchecker.attention.heads import (
    context_residual,
    heads_repair_,
    probs_residual,
    scores_residual,
)
from attnchecker.inject import exponent_flip

MAX_ROWS, MAX_HEADS = 4, 2  # ABFTConfig's defaults
F64 = torch.float64
# name -> (operand dtype, autocast to bf16)
DTYPES = {
    "fp32": (torch.float32, False),
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "autocast": (torch.float32, True),
}
DATA = ("normal", "positive", "lognormal", "outlier", "constant")
LAYOUTS = {
    "single": (("v",),),
    "fused": (("q", "k", "v"),),
    "fused_gqa": (("q", "k", "v"),),  # Phi-3: Q | K | V of heads, heads / 2, heads / 2
    "interleaved": (("q", "k", "v"),),  # GPT-NeoX: [q_h | k_h | v_h] for every head h
    # Megatron-LM's linear_qkv: per KV group g, [q heads of g | k_g | v_g]
    "interleaved_gqa": (("q", "k", "v"),),
    # features no site names around Q | K | V (timm's ParallelScalingBlock: the MLP's first)
    "outside": (("q", "k", "v"),),
    "separate": (("q",), ("k",), ("v",)),
}
OUTSIDE = (2, 1)  # head groups before and after the sites in "outside"


def _site_groups(layout: str, sites: tuple[str, ...], heads: int) -> tuple[int, ...]:
    if layout in ("fused_gqa", "interleaved_gqa"):
        return (heads, max(1, heads // 2), max(1, heads // 2))
    return (heads,) * len(sites)


def _outside(layout: str) -> tuple[int, int]:
    return OUTSIDE if layout == "outside" else (0, 0)


KINDS = ("inf", "-inf", "nan", "1e10", "exp_flip", "random_large")
EXTREME = ("inf", "-inf", "nan", "1e10", "exp_flip")
PATTERNS = ("0D", "1R", "1C", "2D")

# Fractions of the profile's examples (conftest.py: HYPOTHESIS_PROFILE) keep the default run
# short: the clean properties run once per dtype, the fault cases once per kind and pattern.
CLEAN = settings(max_examples=max(10, settings().max_examples // 2))
FEW = settings(max_examples=max(3, settings().max_examples // 15))


def _autocast(on: bool) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _draw(shape: tuple[int, ...], data: str, g: torch.Generator) -> Tensor:
    """float64 values of one data family; "outlier": the first features (last dim) 100x larger,
    with the same sign on every row, as the massive activations of LLM hidden states."""
    x = torch.randn(shape, generator=g, dtype=F64)
    if data == "positive":
        return x.abs()
    if data == "constant":
        return torch.full(shape, 0.7, dtype=F64)
    if data == "lognormal":
        return (2 * x).exp() * torch.randn(shape, generator=g, dtype=F64).sign()
    if data == "outlier":
        n = min(3, shape[-1])
        x[..., :n] = 100 * (x[..., :n].abs() + 1)
    return x


def _fault(kind: str, seed: int = 7):
    """Edits of the selected elements (as the integration tests' KINDS)."""

    def random_large(x: Tensor) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        return (x.double() + torch.empty(x.shape, dtype=F64).uniform_(1e4, 1e8, generator=g)).to(
            x.dtype
        )

    return {
        "inf": lambda x: torch.full_like(x, math.inf),
        "-inf": lambda x: torch.full_like(x, -math.inf),
        "nan": lambda x: torch.full_like(x, math.nan),
        "1e10": lambda x: torch.full_like(x, 1e10, dtype=torch.float32).to(x.dtype),  # fp16: INF
        "exp_flip": exponent_flip,
        "random_large": random_large,
    }[kind]


def _assert_close(t: Tensor, clean: Tensor, magnitude: Tensor, inner: int) -> None:
    """t equals clean up to what recomputing with a smaller GEMM can change: the accumulation
    of ``inner`` terms relative to the elementwise magnitude, and one rounding to t's dtype."""
    u = unit_roundoff(t.dtype)
    acc = magnitude_factor(torch.float32, t.device, inner=inner, length=1)
    err = (t.double() - clean.double()).abs()
    tol = 2 * u * clean.double().abs() + 2 * acc * magnitude.double().abs()
    assert torch.isfinite(t).all(), "non-finite values left"
    worst = int(err.argmax())
    assert (err <= tol).all(), f"error {err.flatten()[worst]:.3g} > {tol.flatten()[worst]:.3g}"


# ----------------------------------------------------------------------------------- projections


@dataclass
class Case:
    """The projections of one input x (B, L, K) and their outputs, as a forward hook sees them."""

    x: Tensor
    pairs: list[tuple[Projection, Tensor]]
    autocast: bool

    def magnitudes(self) -> list[Tensor]:
        """|x| |W|^T + |b| per output (float64), the scale of each element's rounding error."""
        out = []
        for p, _ in self.pairs:
            w = p.weight.double().abs()
            m = self.x.double().abs() @ (w if p.conv1d else w.T)
            out.append(m if p.bias is None else m + p.bias.double().abs())
        return out


def _projections(
    layout: str,
    *,
    B: int,
    L: int,
    K: int,
    heads: int,
    d: int,
    conv1d: bool,
    bias: bool,
    dtype: str,
    scale: float,
    data: str,
    seed: int,
) -> Case:
    """x and the projections of ``layout``, scaled so that max |x W^T| is ``scale`` (the bias
    up to ``scale`` too); the outputs computed with the module's own op."""
    g = torch.Generator().manual_seed(seed)
    dt, auto = DTYPES[dtype]
    x = _draw((B, L, K), data, g)
    w_data = "normal" if data == "outlier" else data
    extra = sum(_outside(layout))
    ws = [
        _draw(((sum(_site_groups(layout, s, heads)) + extra) * d, K), w_data, g)
        for s in LAYOUTS[layout]
    ]
    peak = max(float((x.float() @ w.float().T).abs().max()) for w in ws)
    s = math.sqrt(scale / peak) if peak > 0 else 1.0
    x = (x * s).to(dt)
    pairs = []
    for sites, w in zip(LAYOUTS[layout], ws, strict=True):
        w = (w * s).to(dt)
        b = None
        if bias:
            b = _draw((w.shape[0],), w_data, g)
            b = (b * (scale / max(float(b.abs().max()), 1e-300))).to(dt)
        weight = w.t().contiguous() if conv1d else w
        with _autocast(auto):
            if conv1d:
                x2 = x.view(B * L, K)
                y = x2 @ weight if b is None else torch.addmm(b, x2, weight)
                y = y.view(B, L, -1)
            else:
                y = F.linear(x, weight, b)
        groups = _site_groups(layout, sites, heads)
        uneven = groups if len(set(groups)) > 1 else ()
        interleaved = layout.startswith("interleaved")
        proj = Projection(weight, b, conv1d, sites, sum(groups) + extra, uneven, interleaved,
                          *_outside(layout))  # fmt: skip
        pairs.append((proj, y))
    return Case(x, pairs, auto)


def _check(case: Case, max_rows: int = MAX_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """projection_check_ as AttentionState._check_group calls it (tolerance_scale 1)."""
    with _autocast(case.autocast):
        lim = row_limits(case.x, case.pairs, 1.0)
        return projection_check_(case.x, case.pairs, max_rows=max_rows, bounds=True, **lim)


projection_shapes = {
    "B": st.integers(1, 3),
    "L": st.integers(1, 40),
    "K": st.sampled_from([1, 7, 64, 96, 256, 300]),
    "heads": st.integers(1, 4),
    "d": st.sampled_from([1, 8, 64, 80]),
    "conv1d": st.booleans(),
    "bias": st.booleans(),
}


@CLEAN
@pytest.mark.parametrize("dtype", DTYPES)
@given(
    layout=st.sampled_from(list(LAYOUTS)),
    **projection_shapes,
    data=st.sampled_from(DATA),
    log_scale=st.floats(-3, 4),
    seed=st.integers(0, 2**31),
)
def test_clean_projections_are_never_flagged(dtype, layout, data, log_scale, seed, **shape):
    case = _projections(layout, dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    before = [y.clone() for _, y in case.pairs]
    rec, ref, bound = _check(case)
    n_sites = sum(len(p.sites) for p, _ in case.pairs)
    assert rec.shape == (n_sites, 5)
    assert (rec[:, 0] == 0).all() and (rec[:, 1] == 0).all(), f"false alarm: {rec.tolist()}"
    assert (rec[:, 3] == 0).all() and (rec[:, 4] == 0).all()
    for (_, y), y0 in zip(case.pairs, before, strict=True):
        assert torch.equal(y, y0)  # nothing written but the values already there
    assert (bound > 0).all() and torch.isfinite(ref).all()


# ----------------------------------------------------------------------------------- attention


@dataclass
class Attention:
    """q, k, v (B, H, L|Lk, d); scores, probabilities, context; the ops that recompute them."""

    q: Tensor
    k: Tensor
    v: Tensor
    s: Tensor
    p: Tensor
    c: Tensor
    z: Tensor  # the softmax input (scaled and masked scores)
    alpha: float
    softmax_fp32: bool
    autocast: bool

    def scores(self, b: Tensor | None = None, h: Tensor | None = None) -> Tensor:
        q, k = (self.q, self.k) if b is None else (self.q[b, h], self.k[b, h])
        if self.alpha != 1.0:  # GPT-2's reorder_and_upcast_attn: fp32, scaling in the GEMM
            with torch.autocast("cpu", enabled=False):
                q3, k3 = q.reshape(-1, *q.shape[-2:]).float(), k.reshape(-1, *k.shape[-2:]).float()
                e = torch.empty(q3.shape[0], q3.shape[1], k3.shape[1])
                out = torch.baddbmm(e, q3, k3.mT, beta=0, alpha=self.alpha)
            return out.view(*q.shape[:-1], k.shape[-2])
        return q @ k.mT

    def probs(self, z: Tensor) -> Tensor:
        if self.softmax_fp32:  # Llama
            return F.softmax(z, dim=-1, dtype=torch.float32).to(self.q.dtype)
        p = F.softmax(z, dim=-1)
        return p.to(self.v.dtype) if self.alpha != 1.0 else p  # GPT-2: probs.type(value.dtype)

    def residuals(self) -> dict[str, tuple[Tensor, Tensor]]:
        return {
            "scores": scores_residual(self.s, self.q, self.k, alpha=self.alpha, scale=1.0),
            "probs": probs_residual(self.p, scale=1.0),
            "context": context_residual(self.c, self.p, self.v, scale=1.0),
        }

    def recompute(self, op: str):
        return {
            "scores": self.scores,
            "probs": lambda b, h: self.probs(self.z[b, h]),
            "context": lambda b, h: self.p[b, h] @ self.v[b, h],
        }[op]

    def magnitude(self, op: str) -> tuple[Tensor, int]:
        """Elementwise magnitude of op's output and its inner length, for _assert_close."""
        if op == "scores":
            m = self.q.double().abs() @ self.k.double().abs().mT
            return m * abs(self.alpha), self.q.shape[-1]
        if op == "probs":
            return self.p.double(), 8
        return self.p.double().abs() @ self.v.double().abs(), self.v.shape[-2]


def _repair(t: Tensor, res: Tensor, excess: Tensor, recompute) -> Tensor:
    """heads_repair_ of one tensor by one check (the core chains several)."""
    return heads_repair_([t], [(res, excess)], lambda b, h: [recompute(b, h)], max_heads=MAX_HEADS)


def _attention(
    *,
    B: int,
    H: int,
    L: int,
    Lk: int,
    d: int,
    dtype: str,
    scale: float,
    data: str,
    mask: str,
    softmax_fp32: bool,
    upcast: bool,
    seed: int,
    operands: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Attention:
    """Real softmax attention; q and k scaled so that max |q k^T| is ``scale``, v to max
    ``scale`` (unless ``operands`` gives q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    dt, auto = DTYPES[dtype]
    if operands is None:
        q, k, v = (_draw((B, H, n, d), data, g) for n in (L, Lk, Lk))
        peak = float((q.float() @ k.float().mT).abs().max())
        s = math.sqrt(scale / peak) if peak > 0 else 1.0
        q, k = (q * s).to(dt), (k * s).to(dt)
        v = (v * (scale / max(float(v.abs().max()), 1e-300))).to(dt)
    else:
        q, k, v = operands
    alpha = d**-0.5 if upcast else 1.0
    att = Attention(q, k, v, q, q, q, q, alpha, softmax_fp32, auto)
    with _autocast(auto):
        s = att.scores()
        z = s if upcast else s * d**-0.5
        if mask == "causal":
            keep = torch.ones(L, Lk, dtype=torch.bool).tril(Lk - L)
            z = torch.where(keep, z, torch.finfo(z.dtype).min)
        elif mask == "padding" and Lk >= 4:  # the last quarter of the first sample's keys
            pad = torch.zeros(B, 1, 1, Lk, dtype=z.dtype)  # (never a whole row: in fp16,
            pad[0, ..., Lk - Lk // 4 :] = torch.finfo(z.dtype).min  # z + min may be -INF)
            z = z + pad
        p = att.probs(z)
        c = p @ v
    att.s, att.z, att.p, att.c = s, z, p, c
    return att


attention_shapes = {
    "B": st.integers(1, 3),
    "H": st.integers(1, 4),
    "L": st.integers(1, 40),
    "Lk": st.integers(1, 40),
    "d": st.sampled_from([1, 8, 64]),
    "mask": st.sampled_from(["none", "causal", "padding"]),
    "softmax_fp32": st.booleans(),
    "upcast": st.booleans(),
}
clean_attention = given(
    **attention_shapes,
    data=st.sampled_from(DATA),
    log_scale=st.floats(-3, 4),
    seed=st.integers(0, 2**31),
)  # real softmax attention of any shape, data family and magnitude 1e-3 .. 1e4


@CLEAN
@pytest.mark.parametrize("dtype", DTYPES)
@clean_attention
def test_clean_attention_is_never_flagged(dtype, data, log_scale, seed, **shape):
    att = _attention(dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    for op, (res, excess) in att.residuals().items():
        assert res.shape == excess.shape == att.s.shape[:-1]
        assert (excess <= 0).all(), f"{op}: {int((~(excess <= 0)).sum())} rows flagged"
        t = getattr(att, op[0])
        before = t.clone()
        with _autocast(att.autocast):
            rec = _repair(t, res, excess, att.recompute(op))
        assert rec.shape == (1, 5)
        assert rec[0, 0] == 0 and rec[0, 1] == 0 and rec[0, 3] == 0, f"{op}: {rec.tolist()}"
        assert torch.equal(t, before)


@CLEAN
@pytest.mark.parametrize("dtype", DTYPES)
@clean_attention
def test_probs_sums_riding_on_the_context_gemm(dtype, data, log_scale, seed, **shape):
    """Without dropout the probabilities' row sums come from the context's reference GEMM:
    never flagged on clean data, and a probability that no longer sums to 1 is flagged."""
    att = _attention(dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    _, e_c, _, e_p = context_residual(att.c, att.p, att.v, scale=1.0, with_probs=True)
    assert (e_c <= 0).all() and (e_p <= 0).all()
    p = att.p.clone()
    p[0, 0, 0, 0] = p[0, 0, 0, 0].float() + 0.5
    _, _, _, e_p = context_residual(att.c, p, att.v, scale=1.0, with_probs=True)
    assert not (e_p[0, 0, 0] <= 0) and (e_p.view(-1)[1:] <= 0).all()


def test_one_repair_for_a_chain():
    """A NaN in the scores reaches the probabilities and the context before the repair: one
    repair of the chain restores both, and the fault is counted once, by the scores."""
    d = 16
    att = _attention(
        B=2, H=3, L=8, Lk=8, d=d, dtype="fp32", scale=1.0, data="normal", mask="none",
        softmax_fp32=False, upcast=False, seed=0,
    )  # fmt: skip
    s = att.s.clone()
    s[1, 2, 3, 4] = float("nan")
    p = F.softmax(s * d**-0.5, -1)
    c = p @ att.v
    checks = [
        scores_residual(s, att.q, att.k),
        probs_residual(p, scale=1.0),
        context_residual(c, p, att.v),
    ]

    def chain(b, h):
        new_p = F.softmax(att.scores(b, h) * d**-0.5, -1)
        return [new_p, new_p @ att.v[b, h]]

    rec = heads_repair_([p, c], checks, chain, max_heads=MAX_HEADS)
    assert rec[:, 0].tolist() == [1, 0, 0] and (rec[:, 3] == 0).all(), rec.tolist()
    _assert_close(p, att.p, *att.magnitude("probs"))
    _assert_close(c, att.c, *att.magnitude("context"))


@CLEAN
@pytest.mark.parametrize("dtype", DTYPES)
@given(
    B=st.integers(1, 3),
    L=st.integers(1, 32),
    K=st.sampled_from([16, 96, 256]),
    heads=st.integers(1, 4),
    d=st.sampled_from([8, 64]),
    conv1d=st.booleans(),
    bias=st.booleans(),
    data=st.sampled_from(DATA),
    log_scale=st.floats(-3, 0.5),  # scores ~ d * scale^2 stay inside fp16's range
    seed=st.integers(0, 2**31),
)
def test_clean_attention_with_the_projections_bounds(dtype, data, log_scale, seed, **shape):
    """mode="passing": V's row sums (and their error bound) come from the fused QKV check."""
    case = _projections("fused", dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    rec, ref, bound = _check(case)
    assert (rec[:, :2] == 0).all()
    _, y = case.pairs[0]
    B, L, H, d = shape["B"], shape["L"], shape["heads"], shape["d"]
    q, k, v = (t.view(B, L, H, d).transpose(1, 2) for t in y.split(H * d, -1))
    v_sums = _handed_over(case, ref, bound, B, L, H)
    assert v_sums is not None
    att = _attention(
        B=B, H=H, L=L, Lk=L, d=d, dtype=dtype, scale=1.0, data=data, mask="causal",
        softmax_fp32=False, upcast=False, seed=seed, operands=(q, k, v),
    )  # fmt: skip
    _, e_s = scores_residual(att.s, q, k, alpha=1.0, scale=1.0)
    _, e_c = context_residual(att.c, att.p, v, scale=1.0, v_sums=v_sums)
    assert (e_s <= 0).all() and (e_c <= 0).all()


def _handed_over(case: Case, ref: Tensor, bound: Tensor, B: int, L: int, H: int):
    """What AttentionState._leave hands to the core for the V third of a fused projection."""
    v_cut = slice(2 * H, 3 * H)
    handoff = Handoff(ref[:, v_cut].view(B, L, H), bound[:, v_cut].view(B, L, H))
    d = case.pairs[0][1].shape[-1] // (3 * H)
    return handoff.for_core(torch.empty(B, H, L, d))


# ------------------------------------------------------------------------------ faults: projections


def _projection_index(y: Tensor, pattern: str, at: tuple[int, int, int], size: tuple[int, int]):
    """Where a pattern lands in y (B, L, N): tokens x features of the flattened GEMM; a 2D
    block spans ``size`` = (tokens, features) inside one sample."""
    B, L, N = y.shape
    b, t, o = at[0] % B, at[1] % L, at[2] % N
    if pattern == "0D":
        return (b, t, o)
    if pattern == "1R":
        return (b, t, slice(None))
    if pattern == "1C":
        return (slice(None), slice(None), o)
    h, w = min(size[0], L), min(size[1], N)
    t, o = min(t, L - h), min(o, N - w)
    return (b, slice(t, t + h), slice(o, o + w))


def _run_projection_fault(case: Case, which: int, idx: tuple, kind: str):
    """Inject, check and repair; returns (record, clean outputs)."""
    clean = [y.clone() for _, y in case.pairs]
    y = case.pairs[which][1]
    y[idx] = _fault(kind)(y[idx].clone())
    assert not torch.equal(y, clean[which]), "the fault changed nothing"
    rec, _, _ = _check(case)
    return rec, clean


def _assert_repaired_or_reported(case: Case, rec: Tensor, clean: list[Tensor]) -> bool:
    """Detected; and either reported lost or every output equals the clean one. Returns lost."""
    assert (rec[:, 0] + rec[:, 1] > 0).any(), f"not detected: {rec.tolist()}"
    lost = bool((rec[:, 3] > 0).any())
    if not lost:
        K = case.x.shape[-1]
        for (_, y), y0, m in zip(case.pairs, clean, case.magnitudes(), strict=True):
            _assert_close(y, y0, m, inner=K + 1)
    return lost


fault_projection = {
    "layout": st.sampled_from(list(LAYOUTS)),
    "which": st.integers(0, 2),
    "B": st.integers(1, 3),
    "L": st.integers(1, 24),
    "K": st.sampled_from([16, 64, 256]),
    "heads": st.integers(1, 3),
    "d": st.sampled_from([4, 32]),
    "conv1d": st.booleans(),
    "bias": st.booleans(),
    "dtype": st.sampled_from(list(DTYPES)),
    "data": st.sampled_from(DATA),
    "log_scale": st.floats(-2, -0.5),  # |y| < 2: the exponent flip multiplies
    "at": st.tuples(st.integers(0, 999), st.integers(0, 999), st.integers(0, 9999)),
    "width": st.integers(1, 5),
    "seed": st.integers(0, 2**31),
}


def _assume_flip_visible(y: Tensor, idx: tuple, kind: str) -> None:
    """An fp16 exponent flip multiplies |x| < 1 by 2^16 only: of a value near zero it is an
    error at rounding level, which no checksum sees (fp32 and bf16 multiply by 2^128)."""
    if kind == "exp_flip" and y.dtype == torch.float16:
        assume(bool((y[idx].abs() >= 1e-3 * y.abs().amax()).all()))


@FEW
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind", KINDS)
@given(**fault_projection)
def test_projection_faults_are_repaired_or_reported(
    kind, pattern, layout, which, dtype, data, log_scale, at, width, seed, **shape
):
    case = _projections(layout, dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    which %= len(case.pairs)
    y = case.pairs[which][1]
    idx = _projection_index(y, pattern, at, (MAX_ROWS - at[0] % MAX_ROWS, width))  # <= MAX_ROWS
    _assume_flip_visible(y, idx, kind)
    rec, clean = _run_projection_fault(case, which, idx, kind)
    lost = _assert_repaired_or_reported(case, rec, clean)
    # The budget: up to MAX_ROWS token rows (0D, 1R, 2D blocks), or one whole column broken by
    # an extreme value (the column check is a range check: INF, NaN, near-INF, large).
    extreme_column = kind in EXTREME and not (kind == "exp_flip" and y.dtype == torch.float16)
    if pattern != "1C" or extreme_column or y.shape[0] * y.shape[1] <= MAX_ROWS:
        assert not lost, f"inside the repair budget, reported lost: {rec.tolist()}"


@FEW
@pytest.mark.parametrize("kind", KINDS)
@given(**fault_projection, extra=st.integers(1, 6))
def test_projection_blocks_beyond_the_budget_are_reported(
    kind, layout, which, dtype, data, log_scale, at, width, extra, seed, **shape
):
    """2D blocks over more tokens than max_rows: repaired (when their columns are located) or
    reported, never left wrong unreported."""
    shape["L"] = max(shape["L"], MAX_ROWS + extra)
    case = _projections(layout, dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    which %= len(case.pairs)
    y = case.pairs[which][1]
    idx = _projection_index(y, "2D", at, (MAX_ROWS + extra, width))
    _assume_flip_visible(y, idx, kind)
    rec, clean = _run_projection_fault(case, which, idx, kind)
    _assert_repaired_or_reported(case, rec, clean)


def _bert_like(dtype: str = "fp32", L: int = 16, seed: int = 0) -> Case:
    return _projections(
        "single", B=2, L=L, K=64, heads=2, d=16, conv1d=False, bias=True,
        dtype=dtype, scale=1.0, data="normal", seed=seed,
    )  # fmt: skip


def test_moderate_whole_column_is_reported():
    """A whole-column error too small for the range check (half its bound) flags every row:
    beyond the row budget, so it is reported lost."""
    case = _bert_like()
    p, y = case.pairs[0]
    clean = y.clone()
    T = y.shape[0] * y.shape[1]
    xs = torch.linalg.vector_norm(case.x.reshape(T, -1), dim=1).add(1).sum()
    total = torch.hypot(torch.linalg.vector_norm(p.weight[5]), p.bias[5])  # ||[W_5 | b_5]||
    y[:, :, 5] += float(0.5 * xs * total / T)
    faulty = y.clone()
    rec, _, _ = _check(case)
    assert rec[0, 0] == T and rec[0, 1] == 0 and rec[0, 3] == 1, rec.tolist()
    changed = ~torch.isclose(y, faulty)
    assert changed.sum() <= MAX_ROWS * y.shape[-1]  # at most the recomputed rows changed
    assert not torch.isclose(y, clean).all()


def test_whole_column_of_extreme_values_is_repaired():
    case = _bert_like(L=40)
    y = case.pairs[0][1]
    clean = y.clone()
    y[:, :, 7] = 1e10
    rec, _, _ = _check(case)
    assert rec[0, 0] == 80 and rec[0, 1] == 1 and rec[0, 3] == 0
    _assert_close(y, clean, case.magnitudes()[0], inner=65)


def test_block_beyond_the_budget_with_one_extreme_column_is_reported():
    """A 2D block over 8 tokens (> max_rows) and two features, one column with values near
    1e8 (breaks the range bound), the other with values near 1e4 (does not, over 512 tokens):
    the flagged column explains only part of the flagged rows, so it must be reported lost or
    fully repaired."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, 256, generator=g)
    w = torch.randn(256, 256, generator=g) / 16
    proj = Projection(w, None, False, ("v",), 4)
    y = F.linear(x, w)
    clean = y.clone()
    y[0, 0:8, 5] += 1e8
    y[0, 0:8, 9] += 1e4
    case = Case(x, [(proj, y)], False)
    rec, _, _ = _check(case)
    assert rec[0, 0] == 8  # every faulty token is flagged
    if rec[0, 3] == 0:  # not reported: then it must have been repaired
        _assert_close(y, clean, case.magnitudes()[0], inner=257)


def test_fused_columns_in_two_sites_are_reported():
    """Two whole columns of -INF in a fused Q|K|V, one in Q and one in K (a block over every
    token across the site boundary): each site sees one flagged column, but one column per
    projection is recomputed, so the other must be reported lost (or repaired)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 16, generator=g)  # 8 tokens > max_rows
    w = torch.randn(24, 16, generator=g) / 4  # Q|K|V of one head of 8 each
    proj = Projection(w, None, False, ("q", "k", "v"), 3)
    y = F.linear(x, w)
    clean = y.clone()
    y[0, :, 7:9] = -math.inf  # columns 7 (the last of Q) and 8 (the first of K)
    case = Case(x, [(proj, y)], False)
    rec, _, _ = _check(case)
    assert rec[:, 0].tolist() == [8, 8, 0]
    if not (rec[:, 3] > 0).any():
        _assert_close(y, clean, case.magnitudes()[0], inner=17)


def test_fp16_head_sums_beyond_the_fp16_range_are_not_flagged():
    """Every output is finite (2000) but the 64 outputs of the head sum to 128,000 > 65,504:
    a sum the check makes, not the model, so it must not flag the rows."""
    x = torch.ones(1, 4, 1, dtype=torch.float16)
    w = torch.full((64, 1), 2000.0, dtype=torch.float16)
    y = F.linear(x, w)
    before = y.clone()
    rec, _, _ = _check(Case(x, [(Projection(w, None, False, ("v",), 1), y)], False), max_rows=2)
    assert rec[0, 0] == 0 and rec[0, 1] == 0 and rec[0, 3] == 0, rec.tolist()
    assert torch.equal(y, before)


def test_passing_context_under_autocast_is_not_flagged():
    """mode="passing" under bf16 autocast: V's row sums handed over come from fp32 x and W,
    while V is computed from their bf16 roundings; the context check must allow for that.
    (x and W are all 0.29394 in fp32; the test found by test_clean_attention_with_the_
    projections_bounds[autocast].)"""
    case = _projections(
        "fused", B=1, L=3, K=16, heads=1, d=8, conv1d=False, bias=False,
        dtype="autocast", scale=10**0.140625, data="constant", seed=0,
    )  # fmt: skip
    rec, ref, bound = _check(case)
    assert (rec[:, :2] == 0).all()
    y = case.pairs[0][1]
    q, k, v = (t.view(1, 3, 1, 8).transpose(1, 2) for t in y.split(8, -1))
    v_sums = _handed_over(case, ref, bound, 1, 3, 1)
    att = _attention(
        B=1, H=1, L=3, Lk=3, d=8, dtype="autocast", scale=1.0, data="constant", mask="causal",
        softmax_fp32=False, upcast=False, seed=0, operands=(q, k, v),
    )  # fmt: skip
    _, naive = context_residual(att.c, att.p, v, scale=1.0)
    _, passing = context_residual(att.c, att.p, v, scale=1.0, v_sums=v_sums)
    assert (naive <= 0).all()
    assert (passing <= 0).all(), passing.tolist()


def test_bad_input_is_reported():
    """A non-finite input makes the recompute repeat the fault: reported, never 'repaired'."""
    case = _bert_like()
    case.x[1, 3, 0] = math.nan
    p, _ = case.pairs[0]
    case.pairs[0] = (p, F.linear(case.x, p.weight, p.bias))
    rec, _, _ = _check(case)
    assert rec[0, 0] > 0 and rec[0, 3] == 1


def test_fused_projection_reports_the_faulty_site():
    case = _projections(
        "fused", B=2, L=8, K=64, heads=2, d=16, conv1d=True, bias=True,
        dtype="fp32", scale=1.0, data="normal", seed=3,
    )  # fmt: skip
    y = case.pairs[0][1]
    clean = y.clone()
    y[1, 2, 2 * 32 + 5] = math.inf  # in V (the third third)
    rec, _, _ = _check(case)
    assert rec[:, 0].tolist() == [0, 0, 1] and (rec[:, 3] == 0).all()
    _assert_close(y, clean, case.magnitudes()[0], inner=65)


def _only(site: int, n: float) -> list[float]:
    """Per-site record counts of Q, K, V with ``n`` at ``site`` and 0 elsewhere."""
    return [n if i == site else 0.0 for i in range(3)]


@pytest.mark.parametrize(("head", "site"), [(0, 0), (1, 1), (3, 2), (2, 0)])
def test_interleaved_projection_reports_the_faulty_site(head, site):
    """GPT-NeoX's query_key_value: per head [q_h | k_h | v_h]; faults in head ``head``'s part
    of ``site`` are counted for that site and repaired (one column, a second one is lost)."""
    case = _projections(
        "interleaved", B=2, L=8, K=64, heads=4, d=16, conv1d=False, bias=True,
        dtype="fp32", scale=1.0, data="normal", seed=9,
    )  # fmt: skip
    y = case.pairs[0][1]
    clean = y.clone()
    col = (head * 3 + site) * 16 + 7
    y[0, 5, col] = math.nan
    y[1, :, col] = math.inf  # the same column over batch 1: 9 rows, one column
    rec, _, _ = _check(case)
    want = _only(site, 9.0)
    assert rec[:, 0].tolist() == want and rec[:, 1].tolist() == [w / 9 for w in want]
    assert (rec[:, 3] == 0).all(), rec.tolist()
    _assert_close(y, clean, case.magnitudes()[0], inner=65)
    y[1, :, col] = y[1, :, col - 5] = math.inf  # two bad columns: one is recomputed
    rec, _, _ = _check(case)
    assert rec[:, 3].tolist() == [float(i == site) for i in range(3)], rec.tolist()


@pytest.mark.parametrize(
    ("group", "at", "site"), [(0, 0, 0), (0, 1, 0), (0, 2, 1), (1, 3, 2), (1, 1, 0)]
)
def test_projection_interleaved_per_kv_group_reports_the_faulty_site(group, at, site):
    """Megatron-LM's linear_qkv: 4 query heads in 2 KV groups, per group [q | q | k | v]; a
    fault at head ``at`` of KV group ``group`` is counted for that head's site and repaired."""
    case = _projections(
        "interleaved_gqa", B=2, L=8, K=64, heads=4, d=16, conv1d=False, bias=True,
        dtype="fp32", scale=1.0, data="normal", seed=11,
    )  # fmt: skip
    p, y = case.pairs[0]
    assert p.per_site == (4, 2, 2) and p.blocks == 2
    assert p.group_order() == (0, 1, 4, 5, 2, 6, 3, 7)  # q heads, k heads, v heads
    clean = y.clone()
    y[1, 3, (group * 4 + at) * 16 + 9] = math.nan
    rec, _, _ = _check(case)
    want = _only(site, 1.0)
    assert rec[:, 0].tolist() == want and (rec[:, 3] == 0).all(), rec.tolist()
    _assert_close(y, clean, case.magnitudes()[0], inner=65)


@pytest.mark.parametrize(("head", "site"), [(0, 0), (1, 0), (2, 0), (4, 1), (6, 2), (8, 0)])
def test_projection_features_outside_the_sites_are_checked_with_the_first(head, site):
    """[2 heads no site names | Q | K | V (2 heads each) | 1 head]: every output is checked
    (one GEMM); a fault outside the sites is counted for Q, the first site, and repaired."""
    case = _projections(
        "outside", B=2, L=8, K=64, heads=2, d=16, conv1d=False, bias=True,
        dtype="fp32", scale=1.0, data="normal", seed=13,
    )  # fmt: skip
    p, y = case.pairs[0]
    assert y.shape[-1] == 9 * 16 and p.per_site == (2, 2, 2) and p.counted == (5, 2, 2)
    clean = y.clone()
    y[0, 6, head * 16 + 2] = -math.inf
    y[1, :, head * 16 + 2] = math.nan  # the same column over batch 1: 9 rows, one column
    rec, _, _ = _check(case)
    want = _only(site, 9.0)
    assert rec[:, 0].tolist() == want and rec[:, 1].tolist() == [w / 9 for w in want]
    assert (rec[:, 3] == 0).all(), rec.tolist()
    _assert_close(y, clean, case.magnitudes()[0], inner=65)


# ------------------------------------------------------------------------------ faults: attention


def _heads_index(t: Tensor, pattern: str, at: tuple[int, ...], size: tuple[int, int]):
    """Where a pattern lands in t (B, H, L, M): inside the matrix of one (batch, head)."""
    B, H, L, M = t.shape
    b, h, i, j = at[0] % B, at[1] % H, at[2] % L, at[3] % M
    if pattern == "0D":
        return (b, h, i, j)
    if pattern == "1R":
        return (b, h, i, slice(None))
    if pattern == "1C":
        return (b, h, slice(None), j)
    rh, rw = min(size[0], L), min(size[1], M)
    i, j = min(i, L - rh), min(j, M - rw)
    return (b, h, slice(i, i + rh), slice(j, j + rw))


def _residual(att: Attention, op: str) -> tuple[Tensor, Tensor]:
    return att.residuals()[op]


fault_attention = {
    "B": st.integers(1, 3),
    "H": st.integers(1, 4),
    "L": st.integers(1, 24),
    "Lk": st.integers(1, 24),
    "d": st.sampled_from([4, 32]),
    "mask": st.sampled_from(["none", "causal", "padding"]),
    "softmax_fp32": st.booleans(),
    "upcast": st.booleans(),
    "dtype": st.sampled_from(list(DTYPES)),
    "data": st.sampled_from(DATA),
    "log_scale": st.floats(-2, -0.5),
    "at": st.tuples(*(st.integers(0, 999) for _ in range(4))),
    "size": st.tuples(st.integers(1, 5), st.integers(1, 5)),
    "seed": st.integers(0, 2**31),
}


@FEW
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["scores", "probs", "context"])
@given(**fault_attention)
def test_attention_faults_are_repaired(
    op, kind, pattern, dtype, data, log_scale, at, size, seed, **shape
):
    """Any pattern inside max_heads (batch, head) matrices is repaired, in every dtype."""
    att = _attention(dtype=dtype, scale=10**log_scale, data=data, seed=seed, **shape)
    t = getattr(att, op[0])
    clean = t.clone()
    idx = _heads_index(t, pattern, at, size)
    if kind == "exp_flip" and t.dtype == torch.float16:
        assume(bool((t[idx].abs() >= 1e-3 * t.abs().amax()).all()))
    t[idx] = _fault(kind)(t[idx].clone())
    assert not torch.equal(t, clean), "the fault changed nothing"
    res, excess = _residual(att, op)
    assert not (excess <= 0).all(), "not detected"
    with _autocast(att.autocast):
        rec = _repair(t, res, excess, att.recompute(op))
    assert rec[0, 0] + rec[0, 1] > 0 and rec[0, 3] == 0, rec.tolist()
    _assert_close(t, clean, *att.magnitude(op))


@FEW
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["scores", "probs", "context"])
@given(
    B=st.integers(1, 3),
    H=st.integers(2, 4),
    L=st.integers(1, 16),
    dtype=st.sampled_from(list(DTYPES)),
    heads=st.integers(1, MAX_HEADS + 2),
    seed=st.integers(0, 2**31),
)
def test_attention_faults_beyond_the_budget_are_reported(op, kind, B, H, L, dtype, heads, seed):
    """One element in each of several matrices: the max_heads worst are repaired; any more
    flagged is reported lost."""
    att = _attention(
        B=B, H=H, L=L, Lk=L, d=16, dtype=dtype, scale=0.5, data="normal", mask="none",
        softmax_fp32=False, upcast=False, seed=seed,
    )  # fmt: skip
    t = getattr(att, op[0])
    clean = t.clone()
    g = torch.Generator().manual_seed(seed)
    heads = min(heads, B * H)
    for m in torch.randperm(B * H, generator=g)[:heads].tolist():
        i, j = (int(torch.randint(0, L, (1,), generator=g)) for _ in range(2))
        at = (m // H, m % H, i, j)
        if kind == "exp_flip" and t.dtype == torch.float16:
            assume(bool(t[at].abs() >= 1e-3 * t.abs().amax()))
        t[at] = _fault(kind)(t[at].clone())
    res, excess = _residual(att, op)
    with _autocast(att.autocast):
        rec = _repair(t, res, excess, att.recompute(op))
    assert rec[0, 0] == heads  # one flagged row per faulty matrix
    assert rec[0, 3] == (heads > MAX_HEADS), rec.tolist()
    if heads <= MAX_HEADS:
        _assert_close(t, clean, *att.magnitude(op))


@pytest.mark.parametrize(("at", "site"), [(4 * 16 + 3, 1), (6 * 16 + 5, 2), (3 * 16, 0)])
def test_fused_gqa_projection_reports_the_faulty_site(at, site):
    """Phi-3's fused Q | K | V of 4, 2 and 2 heads: sites of unequal widths, told apart."""
    case = _projections(
        "fused_gqa", B=2, L=8, K=64, heads=4, d=16, conv1d=False, bias=False,
        dtype="fp32", scale=1.0, data="normal", seed=5,
    )  # fmt: skip
    y = case.pairs[0][1]
    assert y.shape[-1] == (4 + 2 + 2) * 16
    clean = y.clone()
    y[1, 2, at] = math.nan
    rec, _, _ = _check(case)
    want = [0, 0, 0]
    want[site] = 1
    assert rec[:, 0].tolist() == want and (rec[:, 3] == 0).all(), rec.tolist()
    _assert_close(y, clean, case.magnitudes()[0], inner=65)
