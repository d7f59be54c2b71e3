"""The faulty device named (recovery.ledger): a computation fault that repeats, at any size,
makes the device a quarantine candidate, in the drain's events, ``summary()``, the run's
summary, report and the exit message of ``attnchecker train``; a single transient fault, or
numerics (an overflow the operands imply), never does."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from attnchecker import ABFTConfig, cli, protect_, replay
from attnchecker.inject import FaultPlan, Injector
from attnchecker.models.tiny import build
from attnchecker.recovery.diagnosis import RankCounts, classify, tally

from .helpers import batch, fire_once, models

WHERE = "rank 0, host node7, device cpu"


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    monkeypatch.setenv("ATTNCHECKER_HOST", "node7")


def _run(model, handle, steps: int, *, fp16: bool = False) -> list[list]:
    """``steps`` training steps of a tiny Llama, each drained: the events of each drain."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = model(**batch("llama")).loss
            loss.backward()
            if not fp16:
                opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(handle.drain())
    return out


def _named(events) -> list:
    return [e for e in events if e.quarantine]


def test_a_fault_at_every_step_names_the_device_at_its_second_step():
    """One element of layer 0's V projection off by 1e3 x its value (finite: no NaN, no INF),
    every step: corrected each time, and the device named once, at step 2, with the evidence."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn"))

    def stuck(call):  # the same unit, every step
        if call.site == "v" and call.layer == 0 and not call.replay:
            call.tensor[0, 3, 5] *= 1e3

    handle.attach(stuck, sites=["v"])
    drains = _run(model, handle, 4)
    assert [len(_named(d)) for d in drains] == [0, 1, 0, 0]
    [named] = _named(drains[1])
    # the naming marks the drain's fault (no event of its own): the diagnosis and the tallies
    # see the fault alone
    assert (named.step, named.module, named.op, named.count, named.cause) == (
        2, "model.layers.0.self_attn", "v", 1, "fault"
    )  # fmt: skip
    f = classify(drains[1], step=2)
    assert f.ops == ("layer 0 v",) and "1 corrected" in f.message
    counts = RankCounts(0, "node7", "cpu")
    tally(counts, drains[1], f)
    assert (counts.faults, counts.by_op) == (1, {"v": 1})
    [q] = handle.summary()["quarantine"]
    assert (q["rank"], q["host"], q["device"], q["named_at"]) == (0, "node7", "cpu", 2)
    assert q["steps"] == [1, 2, 3, 4] and q["faults"] == 4
    assert q["reason"] == "computation faults at 2 distinct steps within 1000 steps"
    assert list(q["sites"]) == ["layer 0 v"] and "4 x 0D finite" in q["sites"]["layer 0 v"]
    assert "through step 4 on host node7" in q["reproduce"]
    [dev] = handle.summary()["devices"]
    site = dev["sites"]["layer 0 v"]
    assert dev["candidate"] and dev["numerics"] == 0 and site["value"] > 0  # the size seen
    json.dumps(handle.summary()["devices"])  # plain data


def test_a_single_transient_fault_names_nothing():
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn"))
    handle.attach(fire_once("scores", "0D", "1e10"), sites=["scores"])
    drains = _run(model, handle, 3)
    assert [e.op for e in drains[0]] == ["scores"] and not any(_named(d) for d in drains)
    [dev] = handle.summary()["devices"]
    assert (dev["faults"], dev["steps"], dev["candidate"]) == (1, [1], False)
    assert handle.summary()["quarantine"] == []


def test_numerics_at_every_step_never_name_the_device():
    """Layer 0's Q and K weights 3000x too large (a diverging run) under fp16: q . k overflows
    at every step and recomputing gives the same: numerics, counted, never hardware."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn"))
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(3e3)
        attn.k_proj.weight.mul_(3e3)
    drains = _run(model, handle, 3, fp16=True)
    assert all(d and {e.cause for e in d} == {"numerics"} for d in drains)
    [dev] = handle.summary()["devices"]
    assert dev["numerics"] >= 3 and (dev["faults"], dev["candidate"]) == (0, False)
    assert handle.summary()["quarantine"] == []


# beyond repair (a 2D block over 4 tokens of Q, one row may be recomputed): replayed
LOST = ABFTConfig(policy="replay", max_rows=1)


def _replayed(plan: FaultPlan):
    """Four steps of a tiny GPT-2 under :func:`attnchecker.replay` with ``plan`` injected."""
    model = build("gpt2", seed=1)
    handle = protect_(model, LOST)
    opt = replay(torch.optim.AdamW(model.parameters(), lr=1e-3), handle)
    at, outs = [0], []
    with Injector(model, plan, step_fn=lambda: at[0]), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(4):
            at[0] += 1
            x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i))
            outs.append(opt.step(lambda x=x: _loss(model, x)))
            opt.zero_grad()
    return handle, outs


def _loss(model, x):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss


def _q_block(persistent: bool) -> FaultPlan:
    b = FaultPlan.builder().at(2).site("q", layer=0).kind("nan").pattern("2D", size=(4, 4))
    return (b.persistent() if persistent else b).add().build()


def test_a_replay_that_flags_the_same_check_again_names_the_device_at_once():
    """One step only, but its replay on the same batch and random state flags layer 0's Q
    again: a stuck unit. A replay that comes out clean is intermittent evidence, counted, and
    one such step names nothing."""
    handle, outs = _replayed(_q_block(persistent=True))
    assert outs[1].finding == "persistent fault"
    assert [len(_named(o.events)) for o in outs] == [0, 1, 0, 0]
    [q] = handle.summary()["quarantine"]
    assert q["replays"] == {"reproduced": 1, "clean": 0} and q["steps"] == [2]
    assert q["reason"].startswith("a replay of step 2 on the same batch and random state")
    handle, outs = _replayed(_q_block(persistent=False))
    assert outs[1].finding == "transient" and not any(_named(o.events) for o in outs)
    [dev] = handle.summary()["devices"]
    assert dev["replays"] == {"reproduced": 0, "clean": 1} and not dev["candidate"]


def test_attnchecker_train_names_the_device_in_its_summary_report_and_exit_message(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("ATTNCHECKER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "t.txt").write_text(
        "\n".join(f"ROMEO: Shall I compare thee to a summer's day ({i})?" for i in range(400))
    )
    b = FaultPlan.builder(seed=1)
    for step in (1, 2, 3):
        b = b.at(step).site("scores", layer=0).kind("scale", value=1e3)
        b = b.position(batch=0, head=0, row=5, col=2).add()
    (tmp_path / "plan.json").write_text(b.build().to_json())
    run = tmp_path / "run"
    args = ["train", "--out", str(run), "--steps", "3", "--batch", "2", "--seq-len", "32",
            "--data", str(tmp_path / "texts"), "--protect", "--seed", "5",
            "--faults", str(tmp_path / "plan.json")]  # fmt: skip
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"attnchecker: quarantine candidate: {WHERE}: computation faults at 2" in err
    assert f"Reproduce on host node7: attnchecker train --out {run}" in err
    assert "--seed 5" in err and "checks fire again at steps 1, 2, 3" in err
    summary = json.loads((run / "summary.json").read_text())
    [q] = summary["quarantine"]
    assert (q["device"], q["steps"], list(q["sites"])) == ("cpu", [1, 2, 3], ["layer 0 scores"])
    assert summary["ranks"][0]["quarantine"] == summary["quarantine"]  # gathered per rank
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("quarantine")] == [2]
    assert cli.main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "Quarantine candidates" in page and "(seed 5, config in meta.json)" in page
