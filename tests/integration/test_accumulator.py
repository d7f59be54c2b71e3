"""``check_impl="accumulator"``: the checked linear layers' GEMMs computed by the accumulator GEMM
(``attnchecker.kernels.acc_gemm``, in Triton's interpreter here), each checked on its fp32
accumulator. A clean step equals the plain model's (fp32: within 1e-6 of the loss, 1e-5 of each
gradient: the kernel adds its products in another order than torch), a fault at every linear
site (forward y, dX, dW; the projections' forward, dX, dW; a fused projection's sites each) is
corrected in the same step, and a small
fault that a check of the bf16 outputs cannot see (5e-4 of its row's L1 norm, on one element)
is seen and corrected under autocast."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from attnchecker import ABFTConfig, kernels, protect_
from attnchecker.attention.impl import resolve

from .helpers import PATTERNS, batch, fire_once, max_diff, models, train_step, update_excess

pytestmark = pytest.mark.skipif(
    not (kernels.available() and kernels.interpreting()), reason="needs Triton's interpreter"
)

ACC = ABFTConfig(scope="all_linear", check_impl="accumulator")


def test_it_resolves_to_the_kernels_and_the_accumulator():
    impl = resolve("accumulator", torch.device("cpu"))
    assert impl.kernels and impl.accumulator
    assert not resolve("triton", torch.device("cpu")).accumulator


@pytest.mark.slow  # 150 s; the default run: a small fault's y and dW, llama's clean steps
def test_clean_steps_equal_the_plain_model_and_every_linear_fault_is_corrected():
    base, ref = models("llama", layers=1)
    inputs = batch("llama")
    want = train_step(ref, inputs)
    handle = protect_(base, ACC)
    snapshot = copy.deepcopy(base.state_dict())
    got = train_step(base, inputs)
    assert handle.drain() == []
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
    assert max_diff(got[1], want[1]) <= 1e-5 and update_excess(got, want) <= 1e-5
    kinds = itertools.cycle(("nan", "inf", "1e10", "-inf"))
    cases = [*itertools.product(["model.layers.0.mlp.down_proj"], ("y", "dx", "dw"), PATTERNS),
             *itertools.product(["lm_head"], ("y", "dx", "dw"), ("1R", "2D")),
             *(("model.layers.0.self_attn", s, p) for s in ("q", "v", "out", "dx.q", "dw.out")
               for p in ("1R", "2D"))]  # fmt: skip
    failures = []
    for module, site, pattern in cases:
        base.load_state_dict(snapshot)
        base.zero_grad(set_to_none=True)
        hook = fire_once(site, pattern, next(kinds), layer=None, module=module)
        detach = handle.attach(hook, sites=[site], modules=[module])
        got = train_step(base, inputs)
        detach.remove()
        events = handle.drain()
        ok = (
            bool(hook.fired)
            and torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
            and max_diff(got[1], want[1]) <= 1e-5
            and [(e.module, e.op) for e in events] == [(module, site)]
            and events[0].action in ("corrected", "recomputed")
        )
        if not ok:
            failures.append((module, site, pattern, [(e.op, e.action) for e in events]))
    assert not failures, failures[:5]
    assert handle.summary()["check_regions"]["_linear_grad_region"] == "accumulator"


SMALL = 5e-4


def test_a_fused_projection_records_each_site_of_its_columns():
    """GPT-2's c_attn (one Conv1D, Q | K | V): the accumulator GEMM runs a call a site, so a
    fault in K's columns is K's record, corrected."""
    base, ref = models("gpt2", layers=1)
    inputs = batch("gpt2")
    want = train_step(ref, inputs)
    handle = protect_(base, ACC)
    snapshot = copy.deepcopy(base.state_dict())
    for site, kind in (("q", "nan"), ("k", "1e10"), ("v", "-inf")):
        base.load_state_dict(snapshot)
        base.zero_grad(set_to_none=True)
        hook = fire_once(site, "1R", kind, layer=0)
        detach = handle.attach(hook, sites=[site])
        got = train_step(base, inputs)
        detach.remove()
        events = handle.drain()
        assert hook.fired and [(e.op, e.action) for e in events] == [(site, "corrected")]
        assert torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
        assert max_diff(got[1], want[1]) <= 1e-5


def _small(site: str, module: str):
    """An error of :data:`SMALL` of its row's L1 norm added to the largest element of row 5 of
    ``site``'s output (a few of its bf16 ulps), once."""
    fired = []

    def hook(call):
        if call.site != site or call.module != module or call.replay or fired:
            return
        t = call.tensor.view(-1, call.tensor.shape[-1])
        j = int(t[5].float().abs().argmax())
        l1 = float(t[5].float().abs().sum())
        was = t[5, j].clone()
        t[5, j] = t[5, j] + (SMALL * l1 if t[5, j] >= 0 else -SMALL * l1)
        fired.append(float((t[5, j].float() - was.float()).abs()) / l1)  # as rounded

    hook.fired = fired
    return hook


@pytest.mark.parametrize(("module", "site"), [
    pytest.param("model.layers.0.mlp.down_proj", "y", marks=pytest.mark.slow),
    ("model.layers.0.mlp.up_proj", "dw"),
    pytest.param("model.layers.0.self_attn", "q", marks=pytest.mark.slow),
    pytest.param("model.layers.0.self_attn", "dx.q", marks=pytest.mark.slow),
])  # fmt: skip
def test_a_small_fault_unseen_on_bf16_outputs_is_seen_on_the_accumulator(module, site):
    """The same fault under ``check_impl="triton"`` (the delivered bf16 outputs' check) passes
    unseen: it is below the outputs' rounding bound; the accumulator's check corrects it. A
    linear layer's y and dW in the default run; a projection's q and dX (the same kernel through
    the projection's site spans and the checked backward) in ``make test-all``, for the suite's
    time."""
    seen = {}
    for impl in ("triton", "accumulator"):
        base, _ = models("llama", layers=1)
        handle = protect_(base, ABFTConfig(scope="all_linear", check_impl=impl))
        inputs = batch("llama")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            train_step(base, inputs)  # clean
        assert handle.drain() == []
        hook = _small(site, module)
        handle.attach(hook, sites=[site], modules=[module])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            train_step(base, inputs)
        assert hook.fired and 2e-4 < hook.fired[0] < 1e-3  # far below the outputs' rounding
        seen[impl] = [(e.op, e.action) for e in handle.drain()]
    assert seen["triton"] == []
    assert seen["accumulator"] == [(site, "corrected")]


CLEAN = [("llama", torch.bfloat16),  # the default run; the rest in the slow set (~100 s)
         *(pytest.param(f, torch.bfloat16, marks=pytest.mark.slow)
           for f in ("gpt2", "bert", "bart")),
         pytest.param("llama", torch.float16, marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize(("family", "dtype"), CLEAN)
def test_no_false_alarm_in_clean_steps(family, dtype):
    """Clean training steps under autocast, every linear layer on the accumulator GEMM: no
    record (four families bf16, one fp16; qwen2 and phi3 bf16 and gpt2 fp16 also passed when
    this was written, left out of the default run for its time)."""
    base, _ = models(family, layers=1)
    handle = protect_(base, ACC)
    inputs = batch(family)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    for _ in range(2):
        with torch.autocast("cpu", dtype=dtype):
            loss = base(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert handle.drain() == []
