"""Linear layers outside attention as placeable, addressable checks: a schedule names a linear
layer's check by its role in the block (``(0, "mlp.c_fc:y", 1)``; ``lm_head`` at layer -1), only
the layers it names are instrumented, and a fault plan reaches any linear layer's GEMM at
``linear:<role>:<op>``, between the GEMM and its check, on a plain model and a protected one
alike (the same elements): corrected where the schedule checks it, on its checked steps."""

from __future__ import annotations

import pytest
import torch

from attnchecker import ABFTConfig, protect_
from attnchecker.attention.ops import linear_op, linear_parts
from attnchecker.attention.schedule import Schedule
from attnchecker.errors import ConfigError, NoMatchingModuleError
from attnchecker.inject import FaultPlan, Injector
from attnchecker.models.registry import role_of

from .helpers import batch, models, train_step

SCHEDULE = ((0, "mlp.c_fc:y", 1), (1, "mlp.c_proj:dw", 2), (-1, "lm_head:dx", 1))


def _config(**kw) -> ABFTConfig:
    return ABFTConfig(scope="all_linear", schedule=SCHEDULE, policy="warn", **kw)


def test_names_roles_and_the_schedule_of_a_linear_layer():
    assert linear_op("mlp.c_fc", "y") == "mlp.c_fc:y"
    assert linear_parts("mlp.c_fc:y") == ("mlp.c_fc", "y")
    assert linear_parts("mlp.c_fc:q") is None and linear_parts("scores") is None
    assert role_of("model.layers.3.mlp.down_proj") == "mlp.down_proj"
    assert role_of("lm_head") == "lm_head" and role_of("h.0") == "h.0"
    s = Schedule((), entries=((0, "mlp.c_fc:y", 1), (0, "mlp.c_fc:dw", 4), (0, "scores", 4)))
    assert s.linear_ops(0, "mlp.c_fc") == {"y", "dw"} and s.linear_ops(1, "mlp.c_fc") == set()
    assert s.linear_ops(0, "mlp.c_fc", step=2) == {"y"}  # dw every 4th step only
    assert s.linear_ops(0, "mlp.c") == set()  # a role is matched whole


def test_a_schedule_instruments_and_checks_only_the_linear_layers_it_names():
    model, _ = models("gpt2", layers=2)
    handle = protect_(model, _config())
    linear = {m: handle.state(m).layer for m in handle.modules if handle.state(m).ops == ("y",)}
    assert linear == {"transformer.h.0.mlp.c_fc": 0, "transformer.h.1.mlp.c_proj": 1,
                      "lm_head": -1}  # fmt: skip
    sched = handle.schedule
    assert sched.ops_of("transformer.h.0.mlp.c_fc", on=True) == {"y"}
    assert sched.ops_of("transformer.h.1.mlp.c_proj", on=True) == {"dw"}
    assert sched.ops_of("transformer.h.1.mlp.c_proj", on=False) == set()  # every 2nd step
    assert sched.ops_of("lm_head", on=False) == {"dx"}
    assert "forward" not in vars(model.transformer.h[1].mlp.c_fc)  # not named: left alone


@pytest.mark.parametrize(
    ("schedule", "scope", "error", "match"),
    [
        (((0, "mlp.c_fc:y", 1),), "attention", ConfigError, "use scope='all_linear'"),
        (((-2, "mlp.c_fc:y", 1),), "all_linear", ConfigError, "layer index"),
        (((-1, "scores", 1),), "attention", ConfigError, "layer index"),
        (((0, "mlp.c_fc:z", 1),), "all_linear", ConfigError, "unknown op"),
        (((0, "mlp.gate:y", 1),), "all_linear", NoMatchingModuleError, r"roles \['lm_head', "),
        (((5, "mlp.c_fc:y", 1),), "all_linear", NoMatchingModuleError, r"\(5, 'mlp.c_fc'\)"),
    ],
)  # fmt: skip
def test_bad_linear_schedules_say_what_is_wrong(schedule, scope, error, match):
    model, _ = models("gpt2", layers=2)
    with pytest.raises(error, match=match):
        protect_(model, ABFTConfig(scope=scope, schedule=schedule))


def _faulty_step(model, site: str, layer: int, step: int = 1, handle=None):
    """Train ``step`` steps (a drain after each when protected) with a NaN at ``site`` in the
    last; (the injector, that step's loss and gradients, its events)."""
    plan = FaultPlan.builder().at(step).site(site, layer=layer).kind("nan").add().build()
    inputs = batch("gpt2")
    with Injector(model, plan) as inj:
        for _ in range(step):
            loss, grads = train_step(model, inputs)[:2]
            events = [] if handle is None else handle.drain()
    return inj, loss, grads, events


@pytest.mark.parametrize(
    ("site", "layer", "step", "checked"),
    [
        ("linear:mlp.c_fc:y", 0, 1, True),
        ("linear:mlp.c_proj:dw", 1, 1, True),
        ("linear:mlp.c_proj:dw", 1, 2, False),  # an unchecked step of an every-2 check
        ("linear:lm_head:dx", -1, 1, True),
        ("linear:mlp.c_fc:y", 1, 1, False),  # a layer the schedule does not check
    ],
)  # fmt: skip
def test_a_linear_fault_lands_in_the_same_elements_and_is_corrected_where_checked(
    site, layer, step, checked
):
    plain, _ = models("gpt2", layers=2)
    protected, _ = models("gpt2", layers=2)
    handle = protect_(protected, _config())
    inj_plain, loss_plain, grads_plain, _ = _faulty_step(plain, site, layer, step)
    inj, loss, grads, events = _faulty_step(protected, site, layer, step, handle)
    [rec_plain], [rec] = inj_plain.records, inj.records
    assert (rec.index, rec.step, rec.layer) == (rec_plain.index, step, layer)
    poisoned = not all(torch.isfinite(g).all() for g in grads_plain.values())
    assert poisoned or not torch.isfinite(loss_plain)  # unchecked, the NaN spreads
    clean = torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    if checked:
        assert clean and [(e.op, e.action) for e in events] == [(site.split(":")[2], "corrected")]
    else:
        assert not clean and not [e for e in events if e.action == "corrected"]


def test_linear_fault_sites_are_checked_when_planned():
    with pytest.raises(ConfigError, match="'linear:<role>:<op>' with op one of"):
        FaultPlan.builder().at(1).site("linear:mlp.c_fc:q").kind("nan").add().build()
    model, _ = models("gpt2", layers=2)
    plan = FaultPlan.builder().at(1).site("linear:mlp.gate:y", layer=0).kind("nan").add().build()
    with pytest.raises(ConfigError, match=r"no linear layer \[\(0, 'mlp.gate'\)\]"):
        Injector(model, plan).__enter__()
    plan = FaultPlan.builder().at(1).site("linear:attn.c_attn:y", layer=0).kind("nan").add()
    with pytest.raises(ConfigError, match="in attention"):
        Injector(model, plan.build()).__enter__()


def test_a_campaign_refuses_a_linear_site_its_model_lacks_before_any_trial(tmp_path, capsys):
    from attnchecker import cli

    args = ["campaign", "--out", str(tmp_path), "--families", "gpt2", "--kinds", "nan",
            "--sites", "scores", "linear:mlp.gate_proj:y", "--layers", "0", "1"]  # fmt: skip
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "gpt2 has no linear layer" in err and "(0, 'mlp.c_fc')" in err and "'lm_head'" in err
    assert not list(tmp_path.glob("trials*.jsonl"))  # nothing ran


def test_a_role_that_names_an_encoder_and_a_decoder_layer_is_refused():
    model, _ = models("bart", layers=1)
    plan = FaultPlan.builder().at(1).site("linear:fc1:y", layer=0).kind("nan").add().build()
    with pytest.raises(ConfigError, match=r"names both model\.encoder\.layers\.0\.fc1 and "):
        Injector(model, plan).__enter__()


def test_summary_lists_a_schedules_linear_checks():
    """summary()["ops"] with a linear layer's entry (it sorted by the attention op table and
    raised ValueError on "mlp.c_fc:y")."""
    schedule = ((0, "mlp.c_fc:y", 1), (0, "scores", 1))
    handle = protect_(models("gpt2")[0], ABFTConfig(scope="all_linear", schedule=schedule))
    assert handle.summary()["ops"] == ["scores", "mlp.c_fc:y"]
