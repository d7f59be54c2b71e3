"""``policy="replay"``: a step that went wrong is recomputed on its batch and random state; a
transient fault then leaves the parameters of the fault-free run, a persistent one is diagnosed
and its update skipped. In the training loop (eager, compiled, two DDP ranks) and in a loop of
one's own (:func:`attnchecker.replay`, with a GradScaler)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from attnchecker import ABFTConfig, cli, protect_, replay
from attnchecker.inject import FaultPlan, Injector
from attnchecker.models.tiny import build
from attnchecker.train.loop import TrainConfig, train

TEXT = "\n".join(
    f"{who}: Shall I compare thee to a summer's day? Thou art more lovely ({i})."
    for i in range(400)
    for who in ("ROMEO", "JULIET")
)
# beyond repair (a 2D block over 4 tokens of Q, one row may be recomputed): uncorrectable
LOST = ABFTConfig(policy="replay", max_rows=1)
GRAD = "grad:transformer.h.0.mlp.c_fc.weight"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ATTNCHECKER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def data(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "sonnets.txt").write_text(TEXT)
    return (str(tmp_path / "texts"),)


def _cfg(data, **kw):
    base = dict(family="gpt2", size="tiny", steps=6, batch=4, seq_len=32, vocab_size=300)
    return TrainConfig(**(base | kw), data=data)


def _q_block(step: int, *, persistent: bool = False, rows: int = 4) -> FaultPlan:
    b = FaultPlan.builder().at(step).site("q", layer=0).kind("nan").pattern("2D", size=(rows, 4))
    return (b.persistent() if persistent else b).add().build()


def _nan_grad(*steps: int, persistent: bool = False) -> FaultPlan:
    b = FaultPlan.builder().site(GRAD).kind("nan")
    b = b.persistent() if persistent else b
    for s in steps:
        b = b.at(s).add()
    return b.build()


def _equal(a, b) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for k, v in wa.items():
        assert torch.equal(v, wb[k]), k


def _close(a, b) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for k, v in wa.items():
        torch.testing.assert_close(wb[k], v, rtol=0, atol=1e-6)


def _events(run, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["type"] == kind]


def test_a_transient_uncorrectable_fault_is_replayed_to_the_fault_free_parameters(tmp_path, data):
    """Dropout is on (tiny GPT-2's 0.1): equality needs the replay's random state too."""
    clean = train(_cfg(data, protect=True, abft=LOST), tmp_path / "clean", progress=False)
    run = tmp_path / "faulty"
    s = train(_cfg(data, protect=True, abft=LOST), run, faults=_q_block(2), progress=False)
    assert s["uncorrectable"] >= 1
    assert (s["replays"], s["reproduced"], s["skipped"]) == (1, 0, 0)
    assert s["final_loss"] == clean["final_loss"] and s["steps_done"] == 6
    _equal(tmp_path / "clean", run)
    [r] = _events(run, "replay")
    assert (r["step"], r["reproduced"], r["finding"]) == (2, False, "transient")
    # the replay ran the checks of its step and reports that step
    assert {e["step"] for e in _events(run, "protection")} == {2}


def test_a_persistent_fault_is_diagnosed_and_its_update_skipped(tmp_path, data):
    run = tmp_path / "stuck"
    plan = _q_block(3, persistent=True)
    s = train(_cfg(data, protect=True, abft=LOST), run, faults=plan, progress=False)
    assert (s["replays"], s["reproduced"], s["skipped"]) == (1, 1, 1)
    assert s["faults_injected"] == 2 and not s["non_trainable"] and s["steps_done"] == 6
    [r] = _events(run, "replay")
    assert (r["step"], r["reproduced"], r["finding"]) == (3, True, "persistent fault")
    assert r["message"].startswith("your hardware: a persistent fault")
    assert "layer 0 q" in r["message"]
    # the replay ran its step's checks (the clock and schedule went back): step 3 both times
    assert {e["step"] for e in _events(run, "protection")} == {3}


def test_the_guard_alone_replays_a_non_finite_gradient(tmp_path, data):
    """No protection, policy replay: the finite-gradient guard with replay. A transient NaN
    gradient costs nothing; a persistent one is skipped, its cause untold (nothing checked);
    reproduced in two consecutive steps, the weights are to blame: non-trainable."""
    train(_cfg(data), tmp_path / "clean", progress=False)
    s = train(_cfg(data, policy="replay"), tmp_path / "t", faults=_nan_grad(3), progress=False)
    assert (s["replays"], s["reproduced"], s["skipped"]) == (1, 0, 0)
    _equal(tmp_path / "clean", tmp_path / "t")
    plan = _nan_grad(3, persistent=True)
    s = train(_cfg(data, policy="replay"), tmp_path / "p", faults=plan, progress=False)
    assert (s["reproduced"], s["skipped"], s["non_trainable"]) == (1, 1, False)
    [r] = _events(tmp_path / "p", "replay")
    assert r["finding"] == "numerics" and "nothing is checked" in r["message"]
    plan = _nan_grad(3, 4, persistent=True)
    s = train(_cfg(data, policy="replay"), tmp_path / "pp", faults=plan, progress=False)
    assert (s["reproduced"], s["non_trainable"], s["steps_done"]) == (2, True, 4)
    plan = _nan_grad(3, 5, persistent=True)  # not in a row: step 4 was applied between them
    s = train(_cfg(data, policy="replay"), tmp_path / "p35", faults=plan, progress=False)
    assert (s["reproduced"], s["non_trainable"], s["steps_done"]) == (2, False, 6)
    # skip_step without protection: the guard skips the NaN step, training goes on; two in a
    # row are non-trainable
    s = train(_cfg(data, policy="skip_step"), tmp_path / "s", faults=_nan_grad(3), progress=False)
    assert (s["replays"], s["skipped"], s["non_trainable"]) == (0, 1, False)
    plan = _nan_grad(3, 4)
    s = train(_cfg(data, policy="skip_step"), tmp_path / "s34", faults=plan, progress=False)
    assert (s["skipped"], s["non_trainable"], s["steps_done"]) == (2, True, 4)


@pytest.mark.slow
def test_replay_under_torch_compile(tmp_path, data):
    """A transient NaN gradient in a compiled protected model: the replay ends where the
    fault-free compiled run does. The fault is at a gradient (a hook outside the compiled
    graph): the injector's hooks at attention sites are traced into the graph and recompile it
    every step. Within float32 rounding, not bitwise: the replayed backward runs a graph
    compiled again (measured: 1.4e-7 at most). Two compiled trainings, 76-106 s on 2 cores:
    in ``make test-all``, for the suite's time."""
    cfg = _cfg(data, protect=True, abft=LOST, compile=True, steps=4)
    clean = train(cfg, tmp_path / "clean", faults=_nan_grad(99), progress=False)
    s = train(cfg, tmp_path / "faulty", faults=_nan_grad(2), progress=False)
    assert (s["replays"], s["reproduced"], s["skipped"]) == (1, 0, 0)
    assert s["final_loss"] == pytest.approx(clean["final_loss"], rel=1e-6)
    _close(tmp_path / "clean", tmp_path / "faulty")


@pytest.mark.distributed
def test_two_ranks_replay_together(tmp_path):
    """A transient uncorrectable fault on rank 1: both ranks replay the step (the flag is
    max-reduced) and end identical to each other and to the fault-free two-rank run."""
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "t.txt").write_text(TEXT)
    # 8 token rows: beyond the default config's repair (max_rows=4)
    (tmp_path / "plan.json").write_text(_q_block(2, rows=8).to_json())
    common = ["train", "--nproc", "2", "--steps", "3", "--batch", "2", "--seq-len", "32",
              "--data", str(tmp_path / "texts"), "--protect", "--policy", "replay"]  # fmt: skip
    assert cli.main([*common, "--out", str(tmp_path / "clean")]) == 0
    faulty = ["--out", str(tmp_path / "faulty"), "--faults", str(tmp_path / "plan.json")]
    assert cli.main([*common, *faulty, "--fault-rank", "1"]) == 0
    _equal(tmp_path / "clean", tmp_path / "faulty")
    _equal(tmp_path / "faulty", tmp_path / "faulty" / "rank1")
    for rank_dir in (tmp_path / "faulty", tmp_path / "faulty" / "rank1"):
        [r] = _events(rank_dir, "replay")
        assert (r["step"], r["finding"]) == (2, "transient")


def _steps(model, batches, plan=None, *, handle=None, scaler=None):
    """A loop of one's own under :func:`attnchecker.replay`, the injector counting the loop's
    steps (a replay is another forward pass of the same step); (the optimizer, each step's
    :class:`Replayed`, the parameters after each step)."""
    torch.manual_seed(0)
    opt = replay(torch.optim.AdamW(model.parameters(), lr=1e-3), handle, scaler=scaler)
    at, outs, params = [0], [], []
    with Injector(model, plan or FaultPlan(()), step_fn=lambda: at[0]):
        for x in batches:
            at[0] += 1

            def closure(x=x):
                loss = model(input_ids=x, labels=x).loss
                (loss if scaler is None else scaler.scale(loss)).backward()
                return loss

            outs.append(opt.step(closure))
            opt.zero_grad()
            params.append([p.detach().clone() for p in model.parameters()])
    return opt, outs, params


def test_replay_in_a_loop_of_ones_own():
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i))
               for i in range(4)]  # fmt: skip
    clean = build("gpt2", seed=1)
    faulty = build("gpt2", seed=1)
    _steps(clean, batches, handle=protect_(clean, LOST))
    opt, outs, _ = _steps(faulty, batches, _q_block(2), handle=protect_(faulty, LOST))
    for a, b in zip(clean.parameters(), faulty.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [(o.replayed, o.skipped, o.finding) for o in outs] == [
        (False, False, None), (True, False, "transient"), (False, False, None),
        (False, False, None),
    ]  # fmt: skip
    assert any(e.action == "uncorrectable" for e in outs[1].events)
    assert (opt.replays, opt.transient, opt.skipped) == (1, 1, 0)
    stuck = build("gpt2", seed=1)
    opt, outs, _ = _steps(
        stuck, batches, _q_block(2, persistent=True), handle=protect_(stuck, LOST)
    )
    assert (outs[1].skipped, outs[1].finding, opt.skipped) == (True, "persistent fault", 1)
    # the replay ran step 2's checks and reports step 2 (the clock went back)
    assert {e.step for e in outs[1].events} == {2}


def _unchanged(before, after) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_reproduced_step_is_never_applied():
    """The guard alone: a persistent NaN gradient is skipped, not applied (the replay's own
    gradients are not finite either). Protected, under a GradScaler: a persistent finite
    uncorrectable error is skipped too (the scaler would apply it: its gradients are finite),
    and a non-finite one without the scaler backing its scale off."""
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i))
               for i in range(3)]  # fmt: skip
    _, outs, params = _steps(build("gpt2", seed=1), batches, _nan_grad(2, persistent=True))
    assert (outs[1].replayed, outs[1].skipped, outs[1].finding) == (True, True, "numerics")
    assert _unchanged(params[0], params[1])
    assert all(torch.isfinite(p).all() for p in params[2])
    model = build("gpt2", seed=1)
    handle = protect_(model, LOST)
    plan = (FaultPlan.builder().at(2).site("q", layer=0).kind("random", value=8.0).persistent()
            .pattern("2D", size=(4, 4)).add().build())  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _, outs, params = _steps(model, batches, plan, handle=handle, scaler=scaler)
    assert any(e.action == "uncorrectable" for e in outs[1].events)
    assert (outs[1].skipped, outs[1].finding) == (True, "persistent fault")
    assert _unchanged(params[0], params[1]) and scaler.get_scale() == 2.0**10
    # a non-finite one too: a fault, not an overflow, so the scaler's scale is left alone
    model = build("gpt2", seed=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    stuck = _q_block(2, persistent=True)
    _, outs, params = _steps(model, batches, stuck, handle=protect_(model, LOST), scaler=scaler)
    assert (outs[1].skipped, outs[1].finding) == (True, "persistent fault")
    assert _unchanged(params[0], params[1]) and scaler.get_scale() == 2.0**10


def test_replay_spares_a_grad_scaler_its_back_off():
    """A transient NaN gradient under a GradScaler: without replay the scaler skips the step
    and halves its scale; with replay the step is applied and the scale kept."""
    batches = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i))
               for i in range(3)]  # fmt: skip
    plan = _nan_grad(2)
    scales = {}
    for name, plan_ in (("clean", None), ("faulty", plan)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        model = build("gpt2", seed=1)
        _, outs, _ = _steps(model, batches, plan_, scaler=scaler)
        scales[name] = scaler.get_scale()
        if plan_ is not None:
            assert outs[1].replayed and not outs[1].skipped
    assert scales["faulty"] == scales["clean"] == 2.0**10


def _fsdp_rank(rank: int, world: int, port: int, out: str) -> None:
    import copy
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from .helpers import batch, models

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base, _ = models("llama")
        runs = {}
        for arm in ("clean", "faulty"):
            model = copy.deepcopy(base)
            handle = protect_(model, ABFTConfig(policy="replay", max_heads=1))
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            opt = replay(torch.optim.AdamW(model.parameters(), lr=1e-3), handle)
            fired: list[int] = []

            # +3 in 3 heads with max_heads=1: uncorrectable but finite, so only rank 1's
            # protection knows (the gradients stay finite): the flag must reach rank 0
            def beyond(c, arm=arm, fired=fired):
                here = arm == "faulty" and rank == 1 and c.site == "scores" and c.layer == 0
                if here and len(fired) == 1 and not fired[0]:
                    c.tensor[:, :3, 2, 2] += 3.0
                    fired[0] = 1

            handle.attach(beyond)
            outs = []
            for step in range(3):
                fired[:] = [0] if step == 1 else [1]

                def closure(m=model):
                    loss = m(**batch("llama", seed=rank)).loss
                    loss.backward()
                    return loss

                outs.append(opt.step(closure).replayed)
                opt.zero_grad()
            params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
            runs[arm] = {"replayed": outs, "params": params}
        torch.save(runs, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_ranks_replay_together(tmp_path):
    """FSDP2 (``fully_shard``, two gloo ranks): a transient uncorrectable fault on rank 1 makes
    both ranks replay the step, and both end with the fault-free sharded run's parameters."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["faulty"]["replayed"] == r1["faulty"]["replayed"] == [False, True, False]
    assert r0["clean"]["replayed"] == [False, False, False]
    for n, p in r0["faulty"]["params"].items():
        assert torch.equal(p, r1["faulty"]["params"][n]), n
        assert torch.equal(p, r0["clean"]["params"][n]), n


def test_a_clean_step_under_replay_reads_the_host_once_the_drains_read():
    """The flag the replay decides on comes back in the drain's one transfer: a clean step
    under :func:`attnchecker.replay` synchronises exactly as a protected step and its drain."""
    from attnchecker.testing import count_ops

    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    counts = {}
    for arm in ("drain", "replay"):
        model = build("gpt2", seed=1)
        handle = protect_(model, LOST)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stepper = replay(opt, handle)

        def closure(model=model):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            return loss

        def step(arm=arm, opt=opt, handle=handle, stepper=stepper, closure=closure):
            if arm == "drain":
                closure()
                opt.step()
                handle.drain()
            else:
                stepper.step(closure)

        step()  # the optimizer's state exists
        counts[arm] = count_ops(step).syncs
    assert counts["replay"] == counts["drain"]
