"""``ABFTConfig(backend="triton")``: the fused kernels inside real models (the interpreter on
CPU): training steps equal to the eager engine's, faults in the kernels' GEMMs corrected or
reported through ``handle.drain()``, the projections still checked, generate() with the KV
cache, and the calls the kernels do not cover falling back to the eager engine.

Tolerances against the eager engine (fp32): loss 1e-5 relative, gradients 1e-5 absolute (the
kernels sum in another order).
"""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch

from attnchecker import ABFTConfig, ConfigError, UnsupportedModelError, protect_
from attnchecker.attention.config import ALL_OPS, OPS
from attnchecker.kernels import CHECKS, available, checks_of
from attnchecker.kernels.flash import SITES, KernelFault
from attnchecker.models.families import TABLE
from attnchecker.models.tiny import build

from .helpers import batch, fire_once, max_diff, models, train_step

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")

FUSED = ("llama", "mistral", "qwen3", "phi3", "gpt_neox", "opt", "bart")  # attention dropout 0
TRITON = ABFTConfig(backend="triton")


def _step(base, config, inputs, fault=None):
    model = copy.deepcopy(base)
    handle = protect_(model, config)
    if fault is not None:
        handle.state(handle.modules[0]).kernel_fault = fault
    with warnings.catch_warnings():
        # no fallback to the eager engine (numpy's own warnings in the interpreter are fine)
        warnings.filterwarnings("error", message="attnchecker backend", category=RuntimeWarning)
        result = train_step(model, inputs)
    return result, handle


@pytest.mark.parametrize("family", FUSED)
def test_fused_training_step_equals_the_eager_engine(family):
    base, _ = models(family, layers=1)
    inputs = batch(family)
    (got, h), (want, _) = _step(base, TRITON, inputs), _step(base, ABFTConfig(), inputs)
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=0), (got[0], want[0])
    assert max_diff(got[1], want[1]) <= 1e-5
    assert h.drain() == []
    assert h.state(h.modules[0]).kernel is not None  # the kernels ran


@functools.cache
def _llama_one_layer():
    """A one-layer Llama, its batch and its fault-free fused step (computed once)."""
    base, _ = models("llama", layers=1)
    inputs = batch("llama")
    return base, inputs, _step(base, TRITON, inputs)[0]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("site", sorted(SITES))
def test_kernel_faults_are_corrected_in_a_training_step(site):
    """A NaN in every GEMM of the kernels, forward and backward, of layer 0: the step's loss,
    gradients and update are bitwise those of the fault-free fused step, and drain() says so."""
    base, inputs, want = _llama_one_layer()
    row, col = (3, 2) if site in ("dv", "dk") else (5, 3)
    got, handle = _step(base, TRITON, inputs, KernelFault(site, 1, 0, row, col, math.nan))
    events = handle.drain()
    assert events and all(e.action == "corrected" for e in events), events
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0
    assert max_diff(got[2], want[2]) == 0.0


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_persistent_kernel_fault_is_reported_and_skips_the_step():
    base, _ = models("llama", layers=1)
    fault = KernelFault("dk", 0, 1, 2, 5, math.inf, persistent=True)
    _, handle = _step(base, TRITON.replace(policy="skip_step"), batch("llama"), fault)
    events = handle.drain()
    assert any(e.op == "dk" and e.action == "uncorrectable" for e in events), events
    assert handle.skip_requested
    assert handle.counters()["dk"]["uncorrectable"] == 1


def test_projections_are_still_checked():
    base, _ = models("qwen3", layers=1)
    inputs = batch("qwen3")
    want, _ = _step(base, TRITON, inputs)
    model = copy.deepcopy(base)
    handle = protect_(model, TRITON)
    handle.attach(fire_once("k", "1R", "nan"))
    got = train_step(model, inputs)
    assert [(e.op, e.action) for e in handle.drain()] == [("k", "corrected")]
    assert torch.allclose(got[0], want[0], rtol=1e-6) and max_diff(got[1], want[1]) <= 1e-5


def test_generate_with_kv_cache_gives_the_eager_tokens():
    model = build("llama").eval()
    plain = copy.deepcopy(model)
    handle = protect_(model, TRITON)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    greedy = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    want = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy)
    got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **greedy)
    assert torch.equal(got, want)
    assert handle.drain() == []


def test_attention_dropout_falls_back_to_the_eager_engine_once_warned():
    """BERT's attention dropout (0.1 in training): the fused kernels have no in-kernel dropout,
    so those calls run the checked eager attention, bitwise as the eager backend."""
    import attnchecker.attention.engines as engines

    engines._WARNED.clear()
    base, _ = models("bert")
    inputs = batch("bert")
    model = copy.deepcopy(base)
    handle = protect_(model, TRITON)
    with pytest.warns(RuntimeWarning, match="attention dropout"):
        got = train_step(model, inputs)
    want, _ = _step(base, ABFTConfig(), inputs)
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0
    assert handle.drain() == []


def test_backend_choices():
    with pytest.raises(ConfigError, match="backend must be one of"):
        ABFTConfig(backend="flash")
    with pytest.raises(UnsupportedModelError, match=r"gpt_neo.*attention interface"):
        protect_(build("gpt_neo"), TRITON)
    assert TABLE["gpt_neo"].wiring.patch is not None
    h = protect_(build("llama"), ABFTConfig(backend="auto"))  # CPU: auto is eager
    assert h.state(h.modules[0]).kernel is None


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_the_config_ops_switch_the_kernel_checks():
    """The kernels' checks are ops of the config: forward only (``ops=OPS``) runs none of the
    backward kernel checks, so a fault in the kernels' dK goes unseen (as configured); adding
    ``dk`` switches on the dK accumulator check (and the S^T tile check behind it) alone."""
    base, inputs, _ = _llama_one_layer()
    fault = KernelFault("dk", 0, 1, 2, 3, math.nan)
    for ops, want in ((OPS, []), ((*OPS, "dk"), [("dk", "corrected")])):
        (_, h) = _step(base, TRITON.replace(ops=ops), inputs, fault)
        assert [(e.op, e.action) for e in h.drain()] == want, ops
    assert checks_of(OPS) == {"s", "pv", "softmax"}
    assert checks_of(("dk",)) == {"st", "dk"}
    assert checks_of(ALL_OPS) == set(CHECKS)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_fused_model_compiles_with_fullgraph_once_and_corrects():
    """torch.compile(fullgraph=True) of a protected model on the fused backend: the kernels are
    custom ops, so there is no graph break; clean steps do not recompile; a fault in the
    compiled backward is corrected and reported (its counters ride on a leaf's gradient)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    base, inputs, want = _llama_one_layer()
    model = copy.deepcopy(base)
    # the projections' backward checks compile in test_protect_compile (here they would double
    # the compile time): the kernels' own backward checks are what this test is about
    handle = protect_(model, TRITON.replace(ops=(*OPS, "dk")))
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    losses, frames = [], []
    for _ in range(3):
        loss = compiled(**inputs).loss
        loss.backward()
        losses.append(loss.detach())
        assert handle.drain() == []
        frames.append(backend.frame_count)
    assert frames == [frames[0]] * 3, frames
    assert torch.allclose(losses[0], want[0], rtol=1e-5)
    handle.state(handle.modules[0]).kernel_fault = KernelFault("dk", 0, 1, 2, 3, math.nan)
    compiled(**inputs).loss.backward()
    assert [(e.op, e.action) for e in handle.drain()] == [("dk", "corrected")]
    # placing a fault is a Python object the graph guards on: one recompilation, for tests
    assert backend.frame_count <= frames[0] + 1


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize(
    ("site", "kind", "pattern"),
    [("kernel:s", "nan", "0D"), ("kernel:pv", "exponent_flip", "1R"),
     ("kernel:dq", "inf", "1C"), ("kernel:dv", "random", "0D")],
)  # fmt: skip
def test_fault_plans_reach_the_kernels(site, kind, pattern):
    """A seeded plan at kernel sites: corrected on the checked fused model (its step equals the
    fault-free one), landing on the unchecked one (ops=(): a different step), recorded by the
    injector."""
    from attnchecker.inject import Fault, FaultPlan, Injector

    base, inputs, want = _llama_one_layer()
    plan = FaultPlan((Fault(step=1, site=site, kind=kind, pattern=pattern, layer=0),), seed=3)
    results = {}
    for arm, ops in (("checked", TRITON.ops), ("unchecked", ())):
        model = copy.deepcopy(base)
        handle = protect_(model, TRITON.replace(ops=ops))
        with Injector(model, plan) as inj:
            results[arm] = train_step(model, inputs), handle.drain(), inj.records
    (got, events, records) = results["checked"]
    assert len(records) == 1 and records[0].site == site
    assert events and all(e.action == "corrected" for e in events), events
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) == 0.0
    dead, _, _ = results["unchecked"]  # the same fault, unchecked: the step is not the same
    assert not (
        torch.equal(dead[0], want[0]) and all(torch.equal(dead[1][n], want[1][n]) for n in want[1])
    )


def test_kernel_fault_plans_are_validated():
    from attnchecker.inject import Fault, FaultPlan, Injector

    with pytest.raises(ConfigError, match="unknown kernel site"):
        Fault(step=1, site="kernel:qk")
    with pytest.raises(ConfigError, match="patterns 0D, 1R, 1C"):
        Fault(step=1, site="kernel:s", pattern="2D")
    model = build("llama")
    protect_(model)  # the eager backend: no kernels to reach
    with (
        pytest.raises(ConfigError, match="backend='triton'"),
        Injector(model, FaultPlan((Fault(step=1, site="kernel:s"),))),
    ):
        pass


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_found_inf_skips_a_fused_optimizer_step_on_the_device():
    """A persistent fault in the backward: handle.found_inf() (no host sync) makes a fused
    AdamW skip its update; on a clean step it is 0 and the update happens."""
    from attnchecker.testing import count_ops

    base, inputs, _ = _llama_one_layer()
    for persistent, skipped in ((True, True), (False, False)):
        model = copy.deepcopy(base)
        handle = protect_(model, TRITON.replace(policy="warn"))
        if persistent:
            fault = KernelFault("dv", 0, 0, 1, 2, math.inf, persistent=True)
            handle.state(handle.modules[0]).kernel_fault = fault
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(**inputs).loss.backward()
        counter = count_ops(lambda o=opt, h=handle: setattr(o, "found_inf", h.found_inf()))
        assert counter.syncs == {}
        opt.step()
        same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert same == skipped
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle.drain()


def test_kernels_self_test(monkeypatch):
    """backend="auto" uses the kernels only on a device where they pass a small self-test
    against SDPA; here (the interpreter) they do, and a broken kernel gives the reason."""
    import attnchecker.kernels as kernels
    import attnchecker.kernels.ops as ops

    kernels._SELF_TESTS.clear()
    assert kernels.self_test("cpu") is None
    kernels._SELF_TESTS.clear()

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(ops, "flash_attention", broken)
    assert kernels.self_test("cpu") == "RuntimeError: PassManager::run failed"
    kernels._SELF_TESTS.clear()
