"""``attnchecker.guard(optimizer, handle)``: a step with an uncorrectable error leaves the
parameters and the optimizer state untouched, on the device; a clean step is exactly the plain
optimizer's. Fused optimizers take the flag as ``found_inf`` (no host sync); the others get a
masked update.
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnchecker import ABFTConfig, guard, protect_
from attnchecker.testing import count_ops

from .helpers import batch, models

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


def _uncorrectable(handle) -> None:
    """NaN in three heads of the scores of layer 0 with max_heads=1: beyond the repair budget."""

    def hook(c):
        if c.site == "scores" and c.layer == 0:
            c.tensor[:, :3, 2, 2] = float("nan")

    return handle.attach(hook)


def _state(opt) -> dict:
    return {
        id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
        for p, s in opt.state.items()
    }


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_guard_skips_a_faulty_step_and_matches_a_clean_one(name):
    base, _ = models("bert")
    inputs = batch("bert")
    plain, guarded = copy.deepcopy(base), copy.deepcopy(base)
    opt_plain = OPTIMIZERS[name](plain.parameters())
    handle = protect_(guarded, ABFTConfig(policy="warn", max_heads=1))
    opt = guard(OPTIMIZERS[name](guarded.parameters()), handle)
    for _ in range(2):  # clean steps: exactly the plain optimizer's (state created on the way)
        torch.manual_seed(0)
        plain(**inputs).loss.backward()
        opt_plain.step()
        opt_plain.zero_grad()
        torch.manual_seed(0)
        guarded(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
        assert handle.drain() == []
        assert all(
            torch.equal(a, b) for a, b in zip(plain.parameters(), guarded.parameters(), strict=True)
        )
    before = {n: p.detach().clone() for n, p in guarded.named_parameters()}
    state = _state(opt.optimizer)
    detach = _uncorrectable(handle)
    guarded(**inputs).loss.backward()
    opt.step()
    opt.zero_grad()
    detach.remove()
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        handle.drain()
    assert all(torch.equal(p, before[n]) for n, p in guarded.named_parameters())
    after = _state(opt.optimizer)
    assert all(torch.equal(after[i][k], v) for i, s in state.items() for k, v in s.items()), (
        "optimizer state moved"
    )
    assert float(opt.skipped) == 1.0


def test_guard_of_a_fused_optimizer_never_synchronises():
    base, _ = models("llama")
    handle = protect_(base)
    opt = guard(torch.optim.AdamW(base.parameters(), lr=1e-3, fused=True), handle)
    base(**batch("llama")).loss.backward()
    assert count_ops(opt.step).syncs == {}


def test_a_fault_at_the_first_step_is_skipped_exactly():
    """No optimizer state yet (SGD's momentum buffer would start from the faulty step's
    gradient): the flag is read once and the step not taken at all."""
    base, _ = models("bert")
    handle = protect_(base, ABFTConfig(policy="warn", max_heads=1))
    opt = guard(torch.optim.SGD(base.parameters(), lr=1e-2, momentum=0.9), handle)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    _uncorrectable(handle)
    base(**batch("bert")).loss.backward()
    opt.step()
    assert not opt.optimizer.state  # no momentum buffer was created
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One DDP rank (gloo): a clean step, then a step with an uncorrectable fault on rank 1 only;
    saves its parameters after each."""
    import os

    import torch.distributed as dist

    from .helpers import batch, models, step_and_drain

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base, _ = models("bert")
        handle = protect_(base, ABFTConfig(policy="warn", max_heads=1))
        net = torch.nn.parallel.DistributedDataParallel(base)
        opt = guard(torch.optim.AdamW(base.parameters(), lr=1e-3, fused=True), handle)
        saved = []
        for step in range(2):
            detach = _uncorrectable(handle) if (step == 1 and rank == 1) else None
            step_and_drain(lambda: net(**batch("bert", seed=rank)).loss, opt, handle, detach)
            saved.append({n: p.detach().clone() for n, p in base.named_parameters()})
        torch.save({"params": saved, "skipped": float(opt.skipped)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ranks_skip_together(tmp_path):
    """A fault on rank 1 alone: both ranks skip the step (the flag is max-reduced), so their
    parameters stay identical and equal to those after the clean step."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["skipped"] == r1["skipped"] == 1.0
    for n, p in r0["params"][1].items():
        assert torch.equal(p, r1["params"][1][n]), n  # ranks identical
        assert torch.equal(p, r0["params"][0][n]), n  # the faulty step was skipped


# Under torch.amp.GradScaler: the scaler's overflow flag and protection's combine (either skips),
# and the scaler's grad_scale reaches a fused optimizer. GradScaler("cpu") runs the code it runs
# on CUDA (fused optimizers unscale in the kernel; the others are unscaled, checked on the host
# and not stepped on an overflow), so fp16 autocast on the CPU tests the same composition.

AMP_OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
}
SCALE = 2.0**10  # low enough that no clean fp16 gradient of the tiny model overflows


def _finite_uncorrectable(handle):
    """As :func:`_uncorrectable`, but finite (+3, not NaN): the gradients stay finite, so the
    scaler sees no overflow and only protection's flag can skip the step."""

    def hook(c):
        if c.site == "scores" and c.layer == 0 and not c.replay:
            c.tensor[:, :3, 2, 2] += 3.0

    return handle.attach(hook)


def _amp_arms(name):
    """Two protected copies of one model, each with an optimizer and a GradScaler: the first
    stepped as ``scaler.step(opt)``, the second as ``scaler.step(guard(opt, handle))``."""
    base, _ = models("bert")
    arms = []
    for wrap in (False, True):
        model = copy.deepcopy(base)
        handle = protect_(model, ABFTConfig(policy="warn", max_heads=1))
        opt = AMP_OPTIMIZERS[name](model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        arms.append((model, handle, guard(opt, handle) if wrap else opt, scaler))
    return arms


def _amp_step(model, opt, scaler, *, inf: bool = False) -> None:
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch("bert")).loss
    scaler.scale(loss).backward()
    if inf:  # one overflowed gradient
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", AMP_OPTIMIZERS)
def test_guard_under_grad_scaler_matches_a_clean_step(name):
    (plain, h_plain, opt_plain, sc_plain), (guarded, handle, opt, sc) = _amp_arms(name)
    start = [p.detach().clone() for p in guarded.parameters()]
    for _ in range(2):
        _amp_step(plain, opt_plain, sc_plain)
        _amp_step(guarded, opt, sc)
        assert h_plain.drain() == handle.drain() == []
        assert _same(plain, guarded)
    assert sc.get_scale() == sc_plain.get_scale() == SCALE  # no overflow: both steps were taken
    assert not all(torch.equal(p, s) for p, s in zip(guarded.parameters(), start, strict=True))
    assert float(opt.skipped) == 0.0


@pytest.mark.parametrize("name", AMP_OPTIMIZERS)
def test_guard_under_grad_scaler_skips_an_overflow(name):
    (plain, _, opt_plain, sc_plain), (guarded, handle, opt, sc) = _amp_arms(name)
    _amp_step(plain, opt_plain, sc_plain)
    _amp_step(guarded, opt, sc)
    before = {n: p.detach().clone() for n, p in guarded.named_parameters()}
    state = _state(opt.optimizer)
    _amp_step(plain, opt_plain, sc_plain, inf=True)
    _amp_step(guarded, opt, sc, inf=True)
    assert handle.drain() == []
    for n, p in guarded.named_parameters():
        assert torch.isfinite(p).all() and torch.equal(p, before[n]), n
    after = _state(opt.optimizer)
    assert all(torch.equal(after[i][k], v) for i, s in state.items() for k, v in s.items())
    assert sc.get_scale() == sc_plain.get_scale() == SCALE / 2  # backed off, as usual
    assert _same(plain, guarded)
    assert float(opt.skipped) == 0.0  # the scaler's skip, not protection's


@pytest.mark.parametrize("name", AMP_OPTIMIZERS)
def test_guard_under_grad_scaler_skips_an_uncorrectable_step(name):
    (_, _, _, _), (guarded, handle, opt, sc) = _amp_arms(name)
    _amp_step(guarded, opt, sc)
    before = {n: p.detach().clone() for n, p in guarded.named_parameters()}
    state = _state(opt.optimizer)
    detach = _finite_uncorrectable(handle)
    _amp_step(guarded, opt, sc)
    detach.remove()
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        handle.drain()
    assert sc.get_scale() == SCALE  # the scaler saw no overflow: the skip was protection's
    assert all(torch.equal(p, before[n]) for n, p in guarded.named_parameters())
    after = _state(opt.optimizer)
    assert all(torch.equal(after[i][k], v) for i, s in state.items() for k, v in s.items())
    assert float(opt.skipped) == 1.0


def test_guard_under_grad_scaler_of_a_fused_optimizer_never_synchronises():
    _, (model, _, opt, scaler) = _amp_arms("adamw_fused")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch("bert")).loss
    scaler.scale(loss).backward()
    assert count_ops(lambda: scaler.step(opt)).syncs == {}


@pytest.mark.parametrize("name", ["sgd_momentum", "sgd_fused", "adamw_foreach"])
def test_the_flag_is_read_on_a_first_step_only(name):
    """An optimizer whose first step creates state the guard cannot mask reads the flag once,
    at that step; every later step adds no host synchronisation to the optimizer's own."""
    base, twin = models("llama")
    handle = protect_(base)
    opt = guard(OPTIMIZERS[name](base.parameters()), handle)
    plain = OPTIMIZERS[name](twin.parameters())
    for step in range(2):
        for model in (base, twin):
            model.zero_grad()
            model(**batch("llama")).loss.backward()
        mine, theirs = count_ops(opt.step).syncs, count_ops(plain.step).syncs
        added = {op: n - theirs.get(op, 0) for op, n in mine.items() if n > theirs.get(op, 0)}
        assert bool(added) == (step == 0), (step, mine, theirs)
        handle.drain()
