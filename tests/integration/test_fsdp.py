"""FSDP2 (``fully_shard``, two gloo ranks on CPU): protection works on sharded parameters. A
fault on rank 1 is corrected (both ranks end equal to a fault-free sharded run, and to each
other); an uncorrectable one on rank 1 makes the guarded optimizer skip the step on both."""

from __future__ import annotations

import copy
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.distributed


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from attnchecker import ABFTConfig, guard, protect_

    from .helpers import batch, fire_once, models, step_and_drain

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base, _ = models("llama")
        runs = {}
        for arm in ("clean", "faulty"):
            model = copy.deepcopy(base)
            handle = protect_(model, ABFTConfig(policy="warn", max_heads=1))
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            opt = guard(torch.optim.AdamW(model.parameters(), lr=1e-3), handle)
            steps = []
            for step in range(3):
                detach = None
                if arm == "faulty" and rank == 1 and step == 1:  # corrected
                    detach = handle.attach(fire_once("q", "1R", "nan", layer=0))
                if rank == 1 and step == 2:  # beyond repair (3 heads, max_heads=1), both arms

                    def beyond(c):
                        if c.site == "scores" and c.layer == 0:
                            c.tensor[:, :3, 2, 2] = float("nan")

                    detach = handle.attach(beyond)
                events = step_and_drain(
                    lambda m=model: m(**batch("llama", seed=rank)).loss, opt, handle, detach
                )
                params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
                steps.append((sorted({(e.op, e.action) for e in events}), params))
            runs[arm] = {"steps": steps, "skipped": float(opt.skipped)}
        torch.save(runs, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_protection_correction_and_guard(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r1["faulty"]["steps"][1][0] == [("q", "corrected")]
    for step in range(3):
        got, other, clean = (r["steps"][step][1] for r in (r0["faulty"], r1["faulty"], r0["clean"]))
        for n, p in got.items():
            assert torch.equal(p, other[n]), (step, n)  # the ranks agree
            assert torch.allclose(p, clean[n], atol=1e-5), (step, n)  # = the fault-free run
    assert r0["faulty"]["skipped"] == r1["faulty"]["skipped"] == 1.0  # every rank skipped
    last, before = r0["faulty"]["steps"][2][1], r0["faulty"]["steps"][1][1]
    assert all(torch.equal(p, before[n]) for n, p in last.items())  # the skipped step
