"""Issue 57's fault matrices on every family: a fault in a norm module's output (extreme and
small, in the first and the last norm of the model) is corrected in its forward, and the step's
loss, every gradient and the updated parameters equal the fault-free step's; a fault in the
optimizer's state or parameters of a family's model is corrected after its step."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnchecker import ABFTConfig, guard, protect_
from attnchecker.abft.update import as_rows
from attnchecker.inject.injector import Injector
from attnchecker.inject.plan import Fault, FaultPlan
from attnchecker.models.families import FAMILIES
from attnchecker.models.norms import find_norms

from .helpers import batch, max_diff, models, train_step

NORM = ABFTConfig(ops=(), invariants=("norm",), policy="warn")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_norm_output_fault_is_corrected_in_its_forward(family):
    plain, protected = models(family, dropout=False)
    inputs = batch(family)
    want = train_step(plain, inputs)
    names = [n for n, _ in find_norms(protected)]
    handle = protect_(protected, NORM)
    assert handle.summary()["invariants"]["norm"]["checked"] == names
    start = {n: p.detach().clone() for n, p in protected.named_parameters()}
    for site in (names[0], names[-1]):
        # extreme and small (INF: the campaign test below, on llama's norms and updates)
        for kind, value in (("nan", None), ("scale", 1 + 2**-4)):
            with torch.no_grad():
                for n, p in protected.named_parameters():
                    p.copy_(start[n])
            protected.zero_grad(set_to_none=True)
            plan = FaultPlan([Fault(step=1, site=f"module:{site}", kind=kind, value=value)])
            with Injector(protected, plan) as inj:
                got = train_step(protected, inputs)
            assert len(inj.records) == 1
            events = handle.drain()
            assert [(e.op, e.module, e.action) for e in events] == [
                ("norm", site, "corrected")], (site, kind)  # fmt: skip
            assert float((got[0] - want[0]).abs()) <= 1e-6
            assert max_diff(got[1], want[1]) <= 1e-6, (site, kind)  # every gradient
            assert max_diff(got[2], want[2]) <= 1e-6, (site, kind)  # the update


@pytest.mark.parametrize("family", ["llama", "gpt2", pytest.param("gemma2", marks=pytest.mark.slow),
                                    pytest.param("bert", marks=pytest.mark.slow)])
def test_an_optimizer_fault_in_a_family_model_is_corrected_after_its_step(family):
    """Right after the repair (the step of the fault) every parameter and moment equals the
    fault-free run's to the check's own bound: a repaired element is its row's predicted sum
    less the others, so it is exact to 4 u of the row's L1 norm (the kept and the new sums:
    twice that). Later steps move such a last-bit difference on through AdamW's 1 / sqrt(v)."""

    def run(plan):
        model, _ = models(family, dropout=False)
        handle = protect_(model, ABFTConfig(ops=(), invariants=("update",), policy="warn"))
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        opt = guard(inner, handle, names=model)
        events = []
        with Injector(model, plan, optimizer=inner):
            for step in range(2):
                model(**batch(family, seed=step)).loss.backward()
                opt.step()
                opt.zero_grad()
                events += handle.drain()
        tensors = [p.detach() for p in model.parameters()]
        moments = ("exp_avg", "exp_avg_sq")
        tensors += [inner.state[p][k] for p in model.parameters() for k in moments]
        return tensors, events, [n for n, p in model.named_parameters()]

    clean, events, names = run(FaultPlan([]))
    assert events == []
    name = next(n for n in names if "norm" not in n and "embed" not in n and "bias" not in n)
    for key, kind in (("exp_avg_sq", "inf"), ("param:written", "nan"), ("exp_avg", "scale")):
        fault = Fault(step=2, site=f"optim:{name}:{key}", kind=kind,
                      value=1 + 2**-4 if kind == "scale" else None)  # fmt: skip
        faulty, events, _ = run(FaultPlan([fault]))
        assert events and {e.action for e in events} == {"corrected"}, (key, events)
        assert {e.step for e in events} == {2} and {e.module for e in events} == {name}
        for a, b in zip(clean, faulty, strict=True):
            bound = 8 * 2**-24 * float(as_rows(a).abs().sum(1).max())
            assert float((a - b).abs().max()) <= bound, key


def test_a_norm_the_check_cannot_recompute_is_named_unchecked():
    model, _ = models("llama")
    norm = model.model.norm
    norm.forward = lambda x, f=norm.forward: 2 * f(x)  # not a normalisation any more
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = protect_(model, NORM)
    unchecked = handle.summary()["invariants"]["norm"]["unchecked"]
    assert list(unchecked) == ["model.norm"] and "probed" in unchecked["model.norm"]
    assert any("model.norm" in str(w.message) for w in caught)


def test_a_campaign_faults_the_new_sites_and_the_protected_arm_corrects_them(tmp_path):
    from attnchecker.inject.campaign import CampaignConfig, load_trials, run_campaign

    cfg = CampaignConfig(families=("llama",), sites=("norm", "update.exp_avg_sq", "update.param"),
                         kinds=("inf", "exponent_flip"), steps=3)  # fmt: skip
    run_campaign(cfg, tmp_path, progress=False)
    rows = load_trials(tmp_path)
    assert len(rows) == 6
    # unprotected, most of them change the run (an INF in v only stops its element's update)
    assert sum(r["unprotected"]["outcome"] != "masked" for r in rows) >= 4
    for r in rows:
        assert r["unprotected"]["fired"], r["site"]
        p = r["protected"]
        assert (p["result"], p["detected_at_site"], p["user"]) == ("corrected", True, "corrected")
        assert p["outcome"] == "masked", r["site"]
