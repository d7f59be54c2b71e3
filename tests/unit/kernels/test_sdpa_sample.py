"""The SDPA route's sampled recomputation (``attnchecker.kernels.sdpa_sample``): clean calls
raise no flag (fp32, bf16, fp16; causal, padding and float masks, GQA, outlier features, every
row sampled), a single-element error of 0.01 of its row's L1 norm in S, P or O of a sampled row
is seen (a lowered score too, which the route's invariants miss), so is one in dQ / dK / dV, a
flag joins the route's flags and the repair restores the head, and the draw reads no generator.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnchecker.kernels.sdpa_backend import attention_backward, attention_forward, backend_mask
from attnchecker.kernels.sdpa_check import fwd_repair, fwd_verify, kv_stats, mask_facts
from attnchecker.kernels.sdpa_sample import (
    _bwd_sample_flags,
    bwd_sample,
    coverage,
    fwd_sample,
    fwd_sample_flags,
    sample_rows,
)

B, H, HKV, L, D = 2, 4, 2, 48, 16
SCALE = D**-0.5
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_Q = torch.arange(L).expand(B, H, L)
ALL_K = torch.arange(L).expand(B, HKV, L)


def _operands(dtype=torch.float32, outliers=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (H, HKV, HKV))
    q[..., :2] *= outliers
    k[..., :2] *= outliers
    return tuple(t.to(dtype) for t in (q, k, v))


def _mask(kind):
    keep = torch.ones(B, 1, L, L, dtype=torch.bool).tril()
    keep[1, :, :, :5] = False  # left padding: sample 1's rows 0-4 attend nothing
    if kind == "bool":
        return keep
    if kind == "float":
        bias = torch.linspace(-1, 1, L).expand(B, 1, L, L)
        return torch.where(keep, bias, torch.finfo(torch.float32).min)
    return None


def _run(q, k, v, kind=None):
    m, causal = _mask(kind), kind == "causal"
    bm = backend_mask(m, q)
    out, lse, aux = attention_forward(q, k, v, bm, causal, SCALE)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype)
    dq, dk, dv = attention_backward(grad, q, k, v, out, lse, bm, causal, SCALE, aux)
    return bm, causal, out, lse, grad, dq, dk, dv, mask_facts(m, L)


def _o_bad(q, k, v, bm, causal, out, lse, idx=ALL_Q):
    lse_bad, o_bad, *_ = fwd_sample_flags(q, k, v, bm, out, lse, causal, SCALE, 1.0, idx)
    return lse_bad, o_bad.any(-1)


@pytest.mark.parametrize("outliers", [1.0, 60.0])
@pytest.mark.parametrize("kind", [None, "causal", "bool", "float"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_calls_raise_no_flag_in_any_row(dtype, kind, outliers):
    for seed in range(2):
        q, k, v = _operands(dtype, outliers, seed)
        bm, causal, out, lse, grad, dq, dk, dv, rowmax = _run(q, k, v, kind)
        lse_bad, o_bad = _o_bad(q, k, v, bm, causal, out, lse)
        assert not lse_bad.any() and not o_bad.any()
        bad = _bwd_sample_flags(q, k, v, bm, out, lse, grad, dq, dk, dv, rowmax, causal, SCALE,
                                1.0, ALL_Q, ALL_K)[:3]  # fmt: skip
        assert not any(b.any() for b in bad)


def _eager_row(q, k, v, b, h, i, edit_z=None, edit_p=None):
    """O and LSE of row i of (b, h), causal, recomputed in fp64 after an edit of its scores or
    probabilities (what the kernel would deliver with that fault), in the operands' dtype."""
    kh, vh = k[b, h // (H // HKV)].double(), v[b, h // (H // HKV)].double()
    z = (q[b, h, i].double() @ kh.T) * SCALE
    z[i + 1 :] = -math.inf
    if edit_z is not None:
        z = edit_z(z)
    p = torch.softmax(z, -1)
    if edit_p is not None:
        p = edit_p(p)
    return (p @ vh).to(q.dtype), torch.logsumexp(z, -1).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("site", ["scores", "lowered", "probs", "context"])
def test_an_error_of_a_hundredth_of_its_row_is_seen_when_sampled(dtype, site):
    """Single-element errors of 0.01 of the row's L1 norm (S: of the scaled scores, P: of P's
    row, 1; O: of O's row), at the row's most attended key / largest feature; ``lowered``: the
    score of the key with the largest weight set to -inf (the invariants do not see it: O stays
    a convex combination, the LSE within its bound)."""
    q, k, v = _operands(dtype)
    bm, causal, out, lse, *_ = _run(q, k, v, "causal")
    b, h, i = 1, 2, 30
    kh = k[b, h // 2].double()
    z0 = (q[b, h, i].double() @ kh.T) * SCALE
    z0[i + 1 :] = -math.inf
    top = int(torch.softmax(z0, -1).argmax())
    at = torch.tensor([top])
    size = 0.01 * z0[: i + 1].abs().sum()
    edits = {
        "scores": {"edit_z": lambda z: z.index_add(0, at, size[None])},
        "lowered": {"edit_z": lambda z: z.index_fill(0, at, -math.inf)},
        "probs": {"edit_p": lambda p: p.index_add(0, at, torch.tensor([-0.01], dtype=p.dtype))},
    }
    bad_out, bad_lse = out.clone(), lse.clone()
    if site == "context":
        f = int(out[b, h, i].abs().argmax())
        bad_out[b, h, i, f] += 0.01 * out[b, h, i].float().abs().sum()
    else:
        bad_out[b, h, i], bad_lse[b, h, i] = _eager_row(q, k, v, b, h, i, **edits[site])
    lse_bad, o_bad = _o_bad(q, k, v, bm, causal, bad_out, bad_lse)
    seen = lse_bad | o_bad
    assert seen[b, h, i] and seen.sum() == 1, seen.nonzero()
    # the invariants' view of the same call (the lowered score, P's and O's small errors)
    if site in ("lowered", "probs"):
        flags = fwd_verify(q, k, bad_out, bad_lse, kv_stats(k, v), torch.zeros(2, 7,
                           dtype=torch.float64), torch.ones(1), (0, 1), SCALE,
                           mask_facts(None, L), 1.0)  # fmt: skip
        assert not flags.any()


def test_a_flag_joins_the_route_flags_and_the_repair_restores_the_head():
    q, k, v = _operands()
    _, causal, out, lse, *_ = _run(q, k, v, "causal")
    step = torch.tensor([7.0], dtype=torch.float64)
    idx = sample_rows(step, 3, B, H, L, 2)
    b, h, i = 0, 1, int(idx[0, 1, 0])
    bad_out = out.clone()
    bad_out[b, h, i, 0] += 0.01 * out[b, h, i].abs().sum()
    log = torch.zeros(2, 7, dtype=torch.float64)
    stats, rowmax = kv_stats(k, v), mask_facts(None, L)
    flags = fwd_verify(q, k, bad_out, lse, stats, log, step, (0, 1), SCALE, rowmax, 1.0)
    assert not flags.any()  # inside V's range: the invariants miss it
    fwd_sample(q, k, v, None, bad_out, lse, flags, log, step, (0, 1), causal, SCALE, 1.0, 2, 3,
               False)  # fmt: skip
    assert flags.tolist() == [[0, 2, 0, 0], [0, 0, 0, 0]]
    assert log[1, [0, 1, 5, 6]].tolist() == [1, 1, 1, 7] and not log[0].any()
    fwd_repair(q, k, v, None, bad_out, lse, stats, flags, log, (0, 1), causal, SCALE, rowmax, 1.0)
    assert torch.equal(bad_out, out)


@pytest.mark.parametrize("which", ["dq", "dk", "dv"])
def test_a_backward_error_of_a_hundredth_of_its_row_is_seen_when_sampled(which):
    q, k, v = _operands(torch.bfloat16)
    bm, causal, out, lse, grad, dq, dk, dv, rowmax = _run(q, k, v, "causal")
    grads = {"dq": dq.clone(), "dk": dk.clone(), "dv": dv.clone()}
    t = grads[which]
    row = t[1, 1, 20]
    t[1, 1, 20, int(row.float().abs().argmax())] += 0.01 * row.float().abs().sum()
    q_bad, k_bad, v_bad, *_ = _bwd_sample_flags(
        q, k, v, bm, out, lse, grad, *grads.values(), rowmax, causal, SCALE, 1.0, ALL_Q, ALL_K)
    got = {"dq": q_bad, "dk": k_bad, "dv": v_bad}
    for name, bad in got.items():
        rows = bad.any(-1)
        assert rows.sum() == (name == which), (name, rows.nonzero())
    assert got[which][1, 1, 20].any()
    flags = torch.zeros(B, HKV, dtype=torch.int32)
    rec = torch.zeros(3, 7, dtype=torch.float64)
    iq, ik = ALL_Q[:, :, :2], ALL_K[:, :, :2]  # rows the draw would not hit: nothing
    assert not _bwd_sample_flags(q, k, v, bm, out, lse, grad, *grads.values(), rowmax, causal,
                                 SCALE, 1.0, iq, ik)[["dq", "dk", "dv"].index(which)].any()
    bwd_sample(q, k, v, bm, out, lse, grad, *grads.values(), rowmax, flags, rec, torch.ones(1),
               (0, 1, 2), causal, SCALE, 1.0, L, 0)  # fmt: skip
    bit = {"dq": 1, "dk": 2, "dv": 4}[which]
    group = [1, 0] if which == "dq" else [0, 1]  # (query head 1: K/V group 0; kv head 1)
    assert flags.tolist() == [[0, 0], [bit * g for g in group]] and rec[:, 5].tolist() == [
        float(n == which) for n in ("dq", "dk", "dv")]  # fmt: skip


def test_the_draw_is_stratified_deterministic_and_reads_no_generator():
    state = torch.get_rng_state()
    a = sample_rows(torch.tensor([5.0], dtype=torch.float64), 1, B, H, L, 4)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, sample_rows(torch.tensor([5.0], dtype=torch.float64), 1, B, H, L, 4))
    assert a.shape == (B, H, 4) and all(len(set(r.tolist())) == 4 for r in a.view(-1, 4))
    assert not torch.equal(a, sample_rows(torch.tensor([6.0], dtype=torch.float64), 1, B, H,
                                          L, 4))  # fmt: skip
    # each row equally likely: over many steps, a row is drawn ~s / L of the calls
    hits = torch.zeros(L)
    for s in range(600):
        r = sample_rows(torch.tensor([float(s)], dtype=torch.float64), 2, 1, 1, L, 4)
        hits[r.view(-1)] += 1
    assert abs(hits.mean() / 600 - 4 / L) < 1e-9 and hits.min() > 0.4 * hits.mean()
    cov = coverage(4, L)
    assert cov["per_call"] == 4 / L and cov["expected_steps"] == pytest.approx(L / 4)
    assert coverage(4, L, dropout=0.1)["rows"] == 0


@pytest.mark.parametrize("seed", [12, 18])
def test_the_cpu_kernels_half_precision_dk_partial_sums_raise_no_flag(seed):
    """The CPU flash kernel adds dK and dV a block of 32 query rows at a time in bf16
    (``_CPU_BLOCK``): at L 128 its dK is a few ulps from an fp32 accumulation. Two draws (of
    ``benchmarks/backward_sensitivity.py``'s clean cases) whose dK a bound without those
    roundings flagged, clean."""
    g = torch.Generator().manual_seed(seed)
    Bs, Hs, Ls, d = 8, 12, 128, 64
    q, k, v = (torch.randn(Bs, Hs, Ls, d, generator=g).to(torch.bfloat16) for _ in range(3))
    out, lse, aux = attention_forward(q, k, v, None, True, d**-0.5)
    grad = (torch.randn(Bs, Hs, Ls, d, generator=g) * 1e-3).to(torch.bfloat16)
    dq, dk, dv = attention_backward(grad, q, k, v, out, lse, None, True, d**-0.5, aux)
    every = torch.arange(Ls).expand(Bs, Hs, Ls)
    bad = _bwd_sample_flags(q, k, v, None, out, lse, grad, dq, dk, dv, torch.zeros(1, 1, 1),
                            True, d**-0.5, 1.0, every, every)[:3]  # fmt: skip
    assert not any(b.any() for b in bad)
