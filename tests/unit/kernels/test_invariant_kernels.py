"""The kernels of the checks beyond the GEMMs (kernels/invariants.py) against their eager
references, in Triton's interpreter: the update check's fp64 row sums (to fp64 rounding) and the
norms' per-row excess (the same rows flagged); and the two checks end to end on the kernels
(``check_impl="triton"``), one launch a tensor or a norm call."""

from __future__ import annotations

import pytest
import torch

from attnchecker import ABFTConfig, guard, kernels, protect_
from attnchecker.abft.norm import NormSpec, reference
from attnchecker.inject.injector import Injector
from attnchecker.inject.plan import Fault, FaultPlan
from attnchecker.kernels.invariants import norm_excess, row_sums
from attnchecker.kernels.launches import recorded
from attnchecker.models.tiny import build

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU


@pytest.mark.parametrize("shape", [(37, 100), (3, 2000), (1000,), (8192,)])
def test_the_row_sums_kernel_is_its_reference_to_fp64_rounding(shape):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=g).to(DEVICE)
    m = (torch.randn(shape, generator=g) * 1e-3).to(DEVICE)
    v = (torch.rand(shape, generator=g) * 1e-6).to(DEVICE)
    root = torch.tensor(0.3, device=DEVICE)
    for args, kw in [((p,), {"square": True}), ((p, m, v), {"adam": (root, 1e-8)}),
                     ((p, m), {})]:  # fmt: skip
        want, got = row_sums(*args, **kw), row_sums(*args, kernel=True, **kw)
        assert len(want) == len(got)
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-300)


@pytest.mark.parametrize("spec", [NormSpec("rms", 1e-6), NormSpec("layer", 1e-5),
                                  NormSpec("rms", 1e-6, offset=True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_norm_kernel_flags_the_rows_its_reference_flags(spec, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, 96, generator=g).to(DEVICE, dtype)
    w = torch.randn(96, generator=g).to(DEVICE, dtype)
    b = torch.randn(96, generator=g).to(DEVICE, dtype) if spec.kind == "layer" else None
    y = reference(spec, x, w, b)[0].to(dtype)
    y[2, 1, 5], y[4, 0, 7], y[5, 3, 9] = float("inf"), float("nan"), y[5, 3, 9] * 1.5
    want = norm_excess(spec, x, y, w, b)
    got = norm_excess(spec, x, y, w, b, kernel=True)
    assert (got > 0).nonzero().flatten().tolist() == (want > 0).nonzero().flatten().tolist()
    assert (want > 0).sum() == 3


def test_both_checks_run_on_their_kernels_one_launch_each():
    def run(plan):
        torch.manual_seed(0)
        model = build("llama", "tiny", seed=0, vocab_size=128, layers=1).to(DEVICE)  # few rows
        config = ABFTConfig(ops=(), invariants=("norm", "update"), check_impl="triton",
                            policy="warn")  # fmt: skip
        handle = protect_(model, config)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = guard(inner, handle, names=model)
        ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
        ids = ids.to(DEVICE)
        events = []
        with Injector(model, plan, optimizer=inner), recorded() as launches:
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                events += handle.drain()
        return model, events, launches, handle

    clean, events, launches, handle = run(FaultPlan([]))
    assert events == []
    norms = len(handle.summary()["invariants"]["norm"]["checked"])
    params = len(list(clean.parameters()))
    kinds = [launch.kernel for launch in launches]
    if DEVICE == "cpu":  # (the interpreter's launches are what is recorded)
        assert kinds.count("norm_excess_kernel") == 2 * norms  # one a norm call
        # the step in the checked AdamW kernel, one launch a tensor a step; the row sums of a
        # tensor first seen (the parameter and its zero moments, at the first step) only
        assert kinds.count("checked_adamw_kernel") == 2 * params
        assert kinds.count("row_sums_kernel") == 3 * params
    plan = FaultPlan([
        Fault(step=2, site="module:model.layers.0.post_attention_layernorm", kind="nan"),
        Fault(step=2, site="optim:model.layers.0.mlp.up_proj.weight:exp_avg_sq", kind="inf"),
    ])  # fmt: skip
    faulty, events, _, _ = run(plan)
    assert sorted((e.op, e.action) for e in events) == [
        ("norm", "corrected"), ("update.exp_avg_sq", "corrected"), ("update.param", "corrected")]
    for a, b in zip(clean.parameters(), faulty.parameters(), strict=True):
        assert float((a - b).detach().abs().max()) <= 1e-6


def test_the_checked_adamw_kernel_is_adamw_and_checks_the_update_it_writes():
    """``check_impl="triton"`` (CUDA's default): the guard runs AdamW in the checked kernel, the
    update and its row sums in one pass. Its parameters are torch's AdamW's to fp32 rounding; a
    wrong moment or parameter before the update is corrected in its step; a parameter written
    wrong after the kernel took its sums is seen at the next step's update (the gap of the
    one-pass check, docs/invariants.md)."""
    from attnchecker.recovery.guard import FiniteGradients

    def run(check, plan=None, steps=3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 8)).to(DEVICE)  # fmt: skip
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = guard(inner, FiniteGradients(model.parameters()), check_update=check)
        if check:
            opt.update.kernels = True
            assert opt.update.can_fuse()
        events = []
        with Injector(model, plan or FaultPlan([]), optimizer=inner):
            for s in range(steps):
                x = torch.randn(32, 64, generator=torch.Generator().manual_seed(s)).to(DEVICE)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                events += [(e["op"], e["action"], s) for e in opt.settle()]
        return [p.detach() for p in model.parameters()], events

    plain, _ = run(False)
    checked, events = run(True)
    assert events == []
    for a, b in zip(plain, checked, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=4 * 2**-24 * float(a.abs().max()) * 4)
    for key in ("param", "exp_avg_sq"):
        fault = Fault(step=2, site=f"optim:0.weight:{key}", kind="nan", row=3, col=5)
        faulty, events = run(True, FaultPlan([fault]))
        assert {a for _, a, _ in events} == {"corrected"} and {s for *_, s in events} == {1}
        assert max(float((a - b).abs().max()) for a, b in zip(checked, faulty, strict=True)) <= 1e-6
    late = Fault(step=2, site="optim:0.weight:param:written", kind="scale", value=2.0, row=3,
                 col=5)  # fmt: skip
    _, events = run(True, FaultPlan([late]))
    assert events == [("update.param", "corrected", 2)]  # the next step's


def test_a_flat_tensor_is_rows_not_one_program():
    """A 1-D tensor whose size divides is rows of up to 4,096 (one row would be one program
    streaming all of it); any other size, one row."""
    from attnchecker.abft.update import as_rows

    assert as_rows(torch.zeros(3 * 4096)).shape == (3, 4096)
    assert as_rows(torch.zeros(1536)).shape == (3, 512)
    assert as_rows(torch.zeros(1000)).shape == (1, 1000)
