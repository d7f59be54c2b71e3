"""The training loop: one readable loop for the CLI, the demo and the benchmarks.

``train(TrainConfig(...), out, faults=plan)`` trains a model from ``models.tiny`` presets on the
offline corpus, optionally protected and/or with the checkpoint/restore baseline, and writes a
run directory: ``meta.json``, ``metrics.jsonl`` (one line per step), ``events.jsonl`` (fired
faults, protection events, rollbacks), ``model.safetensors`` and ``summary.json``;
``train_steps`` is the same loop a step at a time (a generator), for runs that take turns.

The loop reads the loss and gradient norm once per step (its single host sync, at the step
boundary), drains protection events there, and then decides: a non-trainable step (NaN/INF loss
or gradient norm, or a loss spike) rolls back to the last checkpoint when the baseline is on
(faults are transient, so the replay does not meet them again), or marks the run non-trainable;
a step with an uncorrectable error under ``policy="skip_step"`` is skipped by the guarded
optimizer (:func:`attnchecker.guard`: fused AdamW with protection's ``found_inf``, reduced over
the ranks, read with the loss).

Every step is diagnosed (:mod:`attnchecker.recovery.diagnosis`): a step with a computation
fault (your hardware) or numerics (NaN / INF or a spike with every check consistent: not your
hardware) writes a ``diagnosis`` line to ``events.jsonl``; ``summary.json`` carries every rank's
counts (``ranks``) and names a rank whose faults stand out (``outlier_ranks``).

Under ``torchrun`` (``WORLD_SIZE`` > 1) the model is wrapped in ``DistributedDataParallel``
(gloo on CPU, nccl on GPU), each rank trains on its own data, faults hit ``fault_rank`` only,
and the ranks agree on every decision (they share the worst loss and the skip flag); rank 0
writes the checkpoints and every rank rolls back to the same one. Protection
repairs a fault before the gradient all-reduce, so all ranks keep identical parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from attnchecker.attention.config import ABFTConfig
from attnchecker.errors import ConfigError
from attnchecker.recovery.diagnosis import RankCounts, classify, gather, here, outliers, tally

if TYPE_CHECKING:
    from attnchecker.models.handle import Event

__all__ = ["TrainConfig", "tally_events", "train", "train_steps"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    family: str = "gpt2"
    model: str | None = None  # the user's config.json (or a directory with one): used over family
    size: str = "tiny"
    task: str = "lm"  # lm: causal LM (decoders) / masked LM (BERT, RoBERTa); cls: tragedy or not
    steps: int = 50
    batch: int = 8
    seq_len: int = 64
    lr: float = 3e-4
    seed: int = 0
    protect: bool = False
    abft: ABFTConfig | None = None
    recovery: str = "none"  # none | checkpoint
    checkpoint_every: int = 10
    warmup: int = 0  # steps of linear learning-rate warmup (a scheduler the checkpoints carry)
    bf16: bool = False
    fp16: bool = False  # CPU fp16 autocast (its range overflows where bf16's does not)
    data: tuple[str, ...] | None = None  # text files or folders; default: Shakespeare
    vocab_size: int = 2048
    stop_when_non_trainable: bool = True
    fault_rank: int = 0  # under torch.distributed, the rank whose computations meet the faults

    def __post_init__(self) -> None:
        if self.task not in ("lm", "cls"):
            raise ConfigError(f"task must be 'lm' or 'cls', got {self.task!r}")
        if self.recovery not in ("none", "checkpoint"):
            raise ConfigError(f"recovery must be 'none' or 'checkpoint', got {self.recovery!r}")
        if self.steps < 1 or self.batch < 1 or self.seq_len < 2 or self.checkpoint_every < 1:
            raise ConfigError("steps, batch and checkpoint_every must be >= 1, seq_len >= 2")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["abft"] = None if self.abft is None else dataclasses.asdict(self.abft)
        return d


def _write(f, row: dict[str, Any]) -> None:
    f.write(json.dumps(row) + "\n")
    f.flush()


def tally_events(events: Iterable[Event]) -> dict[str, int]:
    """Detections, corrections and uncorrectable errors in one drain's ``events``. An event is
    one op's findings since the last drain, ``count`` detections of it, so the totals sum
    ``count``, not events. An uncorrectable event counts all its detections as uncorrectable:
    an Event does not say how many of them were repaired ("recomputed" counts as corrected)."""
    out = {"detected": 0, "corrected": 0, "uncorrectable": 0}
    for e in events:
        out["detected"] += e.count
        out["uncorrectable" if e.action == "uncorrectable" else "corrected"] += e.count
    return out


def train(
    cfg: TrainConfig, out: str | Path, *, faults=None, progress: bool = True
) -> dict[str, Any]:
    """Train as ``cfg`` says into the run directory ``out``; returns the summary."""
    run = train_steps(cfg, out, faults=faults, progress=progress)
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value


def train_steps(
    cfg: TrainConfig, out: str | Path, *, faults=None, progress: bool = True
) -> Generator[dict[str, Any], None, dict[str, Any]]:
    """:func:`train` a step at a time: yields each step's metrics row once written, returns
    the summary. Runs advanced in turn in one process (the demo times its arms alternately, so
    that load hits every arm alike) stay independent: each keeps its own global RNG stream
    (dropout, and what a rollback restores) across its pauses, and its ``wall_time_s`` leaves
    the pauses out."""
    import transformers

    from attnchecker.inject.injector import Injector
    from attnchecker.models.protect import protect_
    from attnchecker.models.tiny import build, from_file
    from attnchecker.recovery.checkpoint import NonTrainableDetector, save_weights
    from attnchecker.recovery.guard import guard
    from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    ckpt_dir = Path(out) / "checkpoints"  # one set for all ranks: rank 0 writes, all read
    out = Path(out) if rank == 0 else Path(out) / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(list(cfg.data) if cfg.data else None)
    blocks = TokenBlocks.build(corpus, tokenizer_for(corpus, cfg.vocab_size), cfg.seq_len)
    tragedy = blocks.label_names.index("tragedies") if "tragedies" in blocks.label_names else -1
    if cfg.model is not None:
        model = from_file(cfg.model, task=cfg.task, seed=cfg.seed, vocab_size=blocks.vocab_size)
    else:
        model = build(
            cfg.family,
            cfg.size,
            task=cfg.task,
            seed=cfg.seed,
            vocab_size=blocks.vocab_size,
            max_len=cfg.seq_len,
        )
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    sched = None
    if cfg.warmup > 0:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    handle = protect_(model, cfg.abft or ABFTConfig(policy="warn")) if cfg.protect else None
    guarded = (
        guard(opt, handle) if handle is not None and handle.config.policy == "skip_step" else None
    )
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if rank != cfg.fault_rank:
        faults = None  # a fault is one node's: the others compute cleanly
    detector = NonTrainableDetector()
    ckpt = (
        _SharedCheckpoints(ckpt_dir, cfg.checkpoint_every, rank, world)
        if cfg.recovery == "checkpoint"
        else None
    )
    meta = {
        "config": cfg.to_dict(),
        "faults": None if faults is None else json.loads(faults.to_json()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "data": {
            "texts": len(corpus.texts),
            "blocks": int(blocks.ids.shape[0]),
            "vocab": blocks.vocab_size,
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    step, non_trainable, last_loss = 0, False, float("nan")
    totals = {
        "save_s": 0.0,
        "load_s": 0.0,
        "saves": 0,
        "rollbacks": 0,
        "replayed_steps": 0,
        "skipped": 0,
    }
    counts = {"detected": 0, "corrected": 0, "uncorrectable": 0}
    torch.manual_seed(cfg.seed)
    t_start, paused = time.perf_counter(), 0.0
    with contextlib.ExitStack() as stack:
        inj = (
            stack.enter_context(Injector(model, faults, step_fn=lambda: step + 1))
            if faults
            else None
        )
        metrics = stack.enter_context((out / "metrics.jsonl").open("w"))
        events_f = stack.enter_context((out / "events.jsonl").open("w"))
        bar = stack.enter_context(_bar(cfg.steps, progress))
        if ckpt is not None:
            t0 = time.perf_counter()
            ckpt.save(0, model, opt, sched)
            totals["save_s"] += time.perf_counter() - t0
            totals["saves"] += 1
        fired_seen = 0
        where = here(next(model.parameters()).device)
        mine, recent = RankCounts(where.rank, where.host, where.device), []
        while step < cfg.steps:
            t0 = time.perf_counter()
            x, y = blocks.batch(step * world + rank, cfg.batch, cfg.seed)  # each rank its own data
            labels = x if cfg.task == "lm" else (y == tragedy).long()
            low = torch.float16 if cfg.fp16 else torch.bfloat16
            with torch.autocast("cpu", dtype=low, enabled=cfg.bf16 or cfg.fp16):
                loss = net(input_ids=x, attention_mask=torch.ones_like(x), labels=labels).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            # the guard's skip flag (before the drain that resets it; reduced over the ranks)
            flag = guarded.flag() if guarded is not None else torch.zeros(())
            if world > 1:  # every rank must take the same decision: share the worst loss
                worst = torch.stack([loss.detach(), grad_norm]).nan_to_num(float("inf"))
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                loss, grad_norm = worst[0], worst[1]
            stats = torch.stack([loss.detach().float(), grad_norm.float(), flag.to(loss.device)])
            loss_v, grad_v, skip_v = stats.tolist()  # the step's one host sync
            for r in inj.records[fired_seen:] if inj else []:
                _write(events_f, {"type": "fault", **r.to_dict()})
            fired_seen = len(inj.records) if inj else 0
            events = handle.drain() if handle else []
            finding = classify(
                events, step=step + 1, loss=loss_v, history=recent, where=where,
                config=None if handle is None else handle.config,
            )  # fmt: skip
            tally(mine, events, finding)
            if finding is not None:
                _write(events_f, finding.to_dict())
            if math.isfinite(loss_v):
                recent = [*recent[-19:], loss_v]
            for key, n in tally_events(events).items():
                counts[key] += n
            for e in events:
                _write(events_f, {"type": "protection", **e.to_dict()})
            if skip_v:  # the guarded optimizer skips the update (on the device)
                guarded.step(flag=flag)
                opt.zero_grad(set_to_none=True)
                totals["skipped"] += 1
                _write(events_f, {"type": "skipped_step", "step": step + 1})
                step += 1
                continue
            status = detector(loss_v, grad_v)
            if status and ckpt is not None:
                opt.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                restored = ckpt.restore(model, opt, sched)
                totals["load_s"] += time.perf_counter() - t1
                totals["rollbacks"] += 1
                totals["replayed_steps"] += step + 1 - restored["step"]
                row = {
                    "type": "rollback",
                    "at_step": step + 1,
                    "to_step": restored["step"],
                    "reason": status,
                }
                _write(events_f, row)
                step = restored["step"]
                continue
            non_trainable |= bool(status)
            if guarded is not None:
                guarded.step(flag=flag)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            step += 1
            last_loss = loss_v
            dt = time.perf_counter() - t0
            # finished_at (unix seconds): how runs advanced in turn interleaved, from files alone
            row = {"step": step, "loss": loss_v, "grad_norm": grad_v, "step_time_s": dt,
                   "faults_injected": fired_seen, "status": status or "ok",
                   "finished_at": time.time()}  # fmt: skip
            _write(metrics, row)
            bar(step, loss_v, row["step_time_s"], fired_seen, counts["corrected"])
            # runs advanced while this one pauses draw from the global CPU generator (the loop
            # trains on the CPU): keep this run's stream, or its dropout would depend on theirs
            paused_at, rng = time.perf_counter(), torch.get_rng_state()
            yield row
            torch.set_rng_state(rng)
            paused += time.perf_counter() - paused_at
            if ckpt is not None and ckpt.due(step):
                t1 = time.perf_counter()
                ckpt.save(step, model, opt, sched)
                totals["save_s"] += time.perf_counter() - t1
                totals["saves"] += 1
            if non_trainable and cfg.stop_when_non_trainable:
                break
    wall = time.perf_counter() - t_start - paused
    save_weights(model, out / "model.safetensors")
    ranks = gather(mine)  # every rank's counts (a collective under a process group)
    if owns_group:
        dist.barrier()
        dist.destroy_process_group()
    summary = {
        "final_loss": last_loss,
        "non_trainable": non_trainable,
        "steps_done": step,
        "faults_injected": len(inj.records) if inj else 0,
        "faults_detected": counts["detected"],
        "faults_corrected": counts["corrected"],
        "uncorrectable": counts["uncorrectable"],
        "wall_time_s": wall,
        **totals,
        "ranks": [r.to_dict() for r in ranks],
        "outlier_ranks": outliers(ranks),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class _SharedCheckpoints:
    """Checkpoints of a data-parallel run: rank 0 saves (the ranks are identical), every rank
    waits for it, and every rank restores the same checkpoint."""

    def __init__(self, directory: Path, every: int, rank: int, world: int) -> None:
        from attnchecker.recovery.checkpoint import CheckpointManager

        self.manager = CheckpointManager(directory, every=every) if rank == 0 else None
        if self.manager is not None:  # a fresh run: never roll back into a previous run's state
            self.manager.clear()
        self.directory, self.every, self.rank, self.world = directory, every, rank, world

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, *state: Any) -> None:
        if self.manager is not None:
            self.manager.save(step, *state)
        if self.world > 1:
            dist.barrier()

    def restore(self, *state: Any) -> dict[str, Any]:
        from attnchecker.recovery.checkpoint import CheckpointManager

        reader = self.manager or CheckpointManager(self.directory, every=self.every)
        return reader.restore(*state)


@contextlib.contextmanager
def _bar(total: int, enabled: bool):
    if not enabled:
        yield lambda *a: None
        return
    from rich.progress import Progress, TextColumn

    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[info]}")) as p:
        task = p.add_task("training", total=total, info="")

        def update(step: int, loss: float, dt: float, injected: int, corrected: int) -> None:
            info = f"loss {loss:.3f} {1e3 * dt:.0f} ms/step faults {injected} corrected {corrected}"
            p.update(task, completed=step, info=info)

        yield update
