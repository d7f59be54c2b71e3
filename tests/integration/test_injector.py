"""The injector on real models: identical faults with and without protection, clean exits."""

from __future__ import annotations

import copy

import pytest
import torch

from attnchecker import ConfigError, protect_
from attnchecker.inject import FaultPlan, Injector

from .helpers import batch, max_diff, models, train_step


def _plan():
    return (
        FaultPlan.builder(seed=11)
        .at(1).site("scores", layer=0).kind("nan").pattern("1R").add()
        .site("v", layer=1).kind("exponent_flip").pattern("2D", size=(2, 3)).add()
        .site("out", layer=0).kind("inf").pattern("0D").add()
        .build()
    )  # fmt: skip


@pytest.mark.parametrize("family", ["bert", "gpt2", "gpt_neo", "llama"])
def test_same_faults_with_and_without_protection(family):
    base, ref = models(family)
    inputs = batch(family)
    want = train_step(ref, inputs)
    runs = {}
    for arm in ("unprotected", "protected"):
        model = copy.deepcopy(base)
        handle = protect_(model) if arm == "protected" else None
        with Injector(model, _plan()) as inj:
            result = train_step(model, inputs)
        runs[arm] = (result, inj.records, handle)
        assert getattr(model, "_attnchecker_handle", None) is handle  # instrumentation undone
    (plain, plain_records, _), (prot, prot_records, handle) = runs["unprotected"], runs["protected"]
    assert [repr(r) for r in plain_records] == [repr(r) for r in prot_records]  # NaN-safe
    assert len(prot_records) == 3
    assert not torch.isfinite(plain[0]) or max_diff(plain[1], want[1]) > 1e-3
    assert torch.allclose(prot[0], want[0], rtol=1e-6) and max_diff(prot[1], want[1]) <= 1e-5
    assert {e.op for e in handle.drain()} == {"scores", "v", "out"}


def test_hooks_are_removed_even_on_exception():
    model, _ = models("bert")

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    plan = FaultPlan.builder().site("module:bert.encoder.layer.0.output").kind("nan").add().build()
    inside = []

    def body() -> None:
        with Injector(model, plan):
            inside.append(hooks())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    assert inside[0] > before
    assert hooks() == before
    assert getattr(model, "_attnchecker_handle", None) is None


def test_steps_module_grad_and_optimizer_sites():
    model, _ = models("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = (
        FaultPlan.builder(seed=2)
        .at(2).site("module:transformer.h.1.mlp").kind("near_inf").add()
        .site("grad:transformer.h.0.attn.c_proj.weight").kind("scale", value=4.0).pattern("1R")
        .add()
        .at(1).site("optim:lm_head.weight:exp_avg:written").kind("nan").add()
        .build()
    )  # fmt: skip
    inputs = batch("gpt2")
    with Injector(model, plan, optimizer=opt) as inj:
        for step in (1, 2):
            model(**inputs).loss.backward()
            fired_before_step = {r.site for r in inj.records}
            opt.step()
            opt.zero_grad()
            if step == 1:
                assert fired_before_step == set()
    assert [(r.site, r.step) for r in inj.records] == [
        ("optim:lm_head.weight:exp_avg:written", 1),
        ("module:transformer.h.1.mlp", 2),
        ("grad:transformer.h.0.attn.c_proj.weight", 2),
    ]
    scaled = inj.records[2]
    assert scaled.new == pytest.approx([4 * v for v in scaled.old])
    assert not inj.unfired


@pytest.mark.parametrize("key", ["exp_avg_sq", "param"])
def test_an_optimizer_fault_at_step_s_changes_step_s_update(key):
    """Issue 57: ``optim:<param>:<key>`` at step s fires before step s's update, which reads it:
    the parameters differ from the clean run's right after step s, not one step later."""
    def run(plan):
        torch.manual_seed(0)
        model, _ = models("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        after = []
        with Injector(model, plan, optimizer=opt) as inj:
            for _ in range(3):
                model(**batch("gpt2")).loss.backward()
                opt.step()
                opt.zero_grad()
                after.append(model.lm_head.weight.detach().clone())
        return after, inj

    clean, _ = run(FaultPlan([]))
    plan = FaultPlan.builder(seed=1).at(2).site(f"optim:lm_head.weight:{key}").kind(
        "scale", value=16.0).add().build()  # fmt: skip
    faulty, inj = run(plan)
    assert [r.step for r in inj.records] == [2]
    assert torch.equal(clean[0], faulty[0])
    assert not torch.equal(clean[1], faulty[1])  # step 2's update read the fault


def test_checkpointing_replays_do_not_fire_twice():
    model, _ = models("llama")
    model.activation_checkpointing_enable()
    plan = (
        FaultPlan.builder()
        .site("module:model.layers.0.mlp")
        .kind("nan")
        .add()
        .site("scores")
        .add()
        .build()
    )
    with Injector(model, plan) as inj:
        train_step(model, batch("llama"))
    assert len(inj.records) == 2


def test_bad_sites_are_refused():
    model, _ = models("bert")
    with (
        pytest.raises(ConfigError, match="optimizer"),
        Injector(model, FaultPlan.builder().site("optim:x:y").add().build()),
    ):
        pass
    with (
        pytest.raises(ConfigError, match="no parameter"),
        Injector(model, FaultPlan.builder().site("grad:nope").add().build()),
    ):
        pass
    with (
        pytest.raises(AttributeError),
        Injector(model, FaultPlan.builder().site("module:nope").add().build()),
    ):
        pass
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
