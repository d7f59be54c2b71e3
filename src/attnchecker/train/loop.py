"""The training loop: one readable loop for the CLI, the demo and the benchmarks.

``train(TrainConfig(...), out, faults=plan)`` trains a model from ``models.tiny`` presets on the
offline corpus, optionally protected and/or with the checkpoint/restore baseline, and writes a
run directory: ``meta.json``, ``metrics.jsonl`` (one line per step), ``events.jsonl`` (fired
faults, protection events, rollbacks), ``model.safetensors`` and ``summary.json``;
``train_steps`` is the same loop a step at a time (a generator), for runs that take turns.
The loop's parts: :meth:`TrainState.build` sets a run up, :func:`train_step` is one forward and
backward read back in one host sync, and the loop decides what to do with it.

The loop reads the loss and gradient norm once per step (its single host sync, at the step
boundary), drains protection events there, and then decides: a non-trainable step (NaN/INF loss
or gradient norm, or a loss spike) rolls back to the last checkpoint when the baseline is on
(faults are transient, so the replay does not meet them again), or marks the run non-trainable;
a step with an uncorrectable error under ``policy="skip_step"`` is skipped by the guarded
optimizer (:func:`attnchecker.guard`: fused AdamW with protection's ``found_inf``, reduced over
the ranks, read with the loss). Under ``policy="replay"`` a step with an uncorrectable error or a
non-finite loss or gradient is first recomputed on its batch with the random state it started
from (:mod:`attnchecker.recovery.replay`): a clean replay is applied, a reproduced one skipped
with its diagnosis (transient / persistent fault / numerics). Without protection
``TrainConfig.policy`` (``skip_step`` or ``replay``) skips or replays a non-finite step: the
finite-gradient guard. Two steps in a row skipped as non-finite or reproduced are non-trainable
(the weights themselves give it: rolled back under the checkpoint baseline).

Every step is diagnosed (:mod:`attnchecker.recovery.diagnosis`): a step with a computation
fault (your hardware) or numerics (NaN / INF or a spike with every check consistent: not your
hardware) writes a ``diagnosis`` line to ``events.jsonl``; ``summary.json`` carries every rank's
counts (``ranks``), names a rank whose faults stand out (``outlier_ranks``) and every device whose
faults repeat, with the evidence (``quarantine``: :mod:`attnchecker.recovery.ledger`).

Under ``torchrun`` (``WORLD_SIZE`` > 1) the model is wrapped in ``DistributedDataParallel``
(gloo on CPU, nccl on GPU), each rank trains on its own data, faults hit ``fault_rank`` only,
and the ranks agree on every decision (they share the worst loss and the skip flag); rank 0
writes the checkpoints and every rank rolls back to the same one. Protection
repairs a fault before the gradient all-reduce, so all ranks keep identical parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from attnchecker.attention.config import POLICIES, ABFTConfig
from attnchecker.errors import ConfigError
from attnchecker.recovery.diagnosis import RankCounts, classify, gather, here, outliers, tally

if TYPE_CHECKING:
    from attnchecker.inject import FaultPlan
    from attnchecker.models.handle import Event, ProtectionHandle
    from attnchecker.recovery.checkpoint import NonTrainableDetector
    from attnchecker.recovery.guard import GuardedOptimizer
    from attnchecker.train.data import TokenBlocks

__all__ = [
    "RECOVERIES",
    "TASKS",
    "StepResult",
    "TrainConfig",
    "TrainState",
    "sampled_faults",
    "tally_events",
    "train",
    "train_step",
    "train_steps",
]


TASKS = ("lm", "cls")  # causal or masked language modelling; a classifier: tragedy or not
RECOVERIES = ("none", "checkpoint")  # the checkpoint/restore baseline, or none


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    family: str = "gpt2"
    model: str | None = None  # package.module:factory, or a config.json (or its directory)
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
    policy: str = "warn"  # unprotected: skip_step / replay a non-finite step (protected: abft's)
    compile: bool = False  # torch.compile the model (after protect_)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task must be 'lm' or 'cls', got {self.task!r}")
        if self.recovery not in RECOVERIES:
            raise ConfigError(f"recovery must be 'none' or 'checkpoint', got {self.recovery!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
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


def sampled_faults(rate: float, steps: int, seed: int) -> FaultPlan | None:
    """``rate`` faults per step on average (at least one; None at rate 0) of the default kinds
    (:data:`attnchecker.inject.kinds.DEFAULT_KINDS`), each at a step drawn from the run's
    ``steps``: ``attnchecker train --fault-rate``."""
    from attnchecker.inject import FaultPlan
    from attnchecker.inject.kinds import DEFAULT_KINDS

    if rate <= 0:
        return None
    n = max(1, round(rate * steps))
    return FaultPlan.sample(n, seed, kinds=DEFAULT_KINDS, steps=tuple(range(1, steps + 1)))


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
    the pauses out.

    Each step is :func:`train_step` (forward, backward, one host sync), what it found written
    down, then one decision: skip it (the guard's flag), roll back (a non-trainable step under
    the checkpoint baseline), or update."""
    state = TrainState.build(cfg, out, faults=faults)
    t_start, paused = time.perf_counter(), 0.0
    with contextlib.ExitStack() as stack:
        log = _RunLog(state, stack, progress)
        if state.ckpt is not None:
            _save_checkpoint(state)
        while state.step < cfg.steps:
            t0 = time.perf_counter()
            before = _before(state)
            result = train_step(state)
            log.step(state, result)
            if state.ckpt is not None and _update_lost(log.last_events):
                _roll_back(state, log, "an update beyond repair")  # the weights are wrong
                continue
            doubtful = False  # skipped as non-finite or reproduced: the weights may be bad
            if before is not None and _wrong(result):
                result = _replay(state, log, before)
                doubtful = result.skip
            elif state.handle is None and state.policy == "skip_step" and _wrong(result):
                result, doubtful = result._replace(skip=True), True  # the guard alone
            if result.skip:
                _skip(state, log)
                state.doubtful = state.doubtful + 1 if doubtful else 0
                if state.doubtful >= 2:  # two in a row: the weights give it, not a step's fault
                    state.doubtful = 0
                    if state.ckpt is not None:
                        _roll_back(state, log, "reproduced twice")
                        continue
                    state.non_trainable = True
                    if cfg.stop_when_non_trainable:
                        break
                continue
            status = state.detector(result.loss, result.grad_norm)
            if status and state.ckpt is not None:
                _roll_back(state, log, status)
                continue
            state.non_trainable |= bool(status)
            _update(state, result)
            row = log.metrics(state, result, status, time.perf_counter() - t0)
            # runs advanced while this one pauses draw from the global CPU generator (the loop
            # trains on the CPU): keep this run's stream, or its dropout would depend on theirs
            paused_at, rng = time.perf_counter(), torch.get_rng_state()
            yield row
            torch.set_rng_state(rng)
            paused += time.perf_counter() - paused_at
            if state.ckpt is not None and state.ckpt.due(state.step) and not (
                state.handle is not None and _update_lost(state.handle.settle())
            ):  # (an update beyond repair is not saved: the next step rolls back past it)
                _save_checkpoint(state)
            if state.non_trainable and cfg.stop_when_non_trainable:
                break
    return _finish(state, log, wall=time.perf_counter() - t_start - paused)


class StepResult(NamedTuple):
    """What :func:`train_step` read back (agreed over the ranks): the loss, the gradient norm,
    whether the guarded optimizer must skip the update, and the guard's flag on the device."""

    loss: float
    grad_norm: float
    skip: bool
    flag: torch.Tensor


@dataclass(eq=False)
class TrainState:
    """One run between its steps, set up by :meth:`build`: the model (``net``: the same, wrapped
    for DDP under torchrun), its optimizer, learning-rate schedule and protection, its data and
    checkpoints, and where it stands (``step``: the steps done, rollbacks included)."""

    cfg: TrainConfig
    out: Path  # this rank's run directory
    rank: int
    world: int
    owns_group: bool  # this run started the process group, and ends it
    blocks: TokenBlocks
    tragedy: int  # the label of a tragedy (task "cls"), -1 when the texts have none
    model: torch.nn.Module
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler | None
    handle: ProtectionHandle | None
    guarded: GuardedOptimizer | None  # protected, under policy "skip_step" or "replay"
    faults: FaultPlan | None  # None on every rank but cfg.fault_rank
    detector: NonTrainableDetector
    ckpt: _SharedCheckpoints | None  # the checkpoint/restore baseline
    step: int = 0
    doubtful: int = 0  # consecutive steps skipped as non-finite or reproduced
    non_trainable: bool = False
    last_loss: float = float("nan")
    # recovery's costs: checkpoint save / load seconds and counts, replays, skipped steps
    totals: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"save_s": 0.0, "load_s": 0.0, "saves": 0, "rollbacks": 0,
                                 "replayed_steps": 0, "skipped": 0, "replays": 0,
                                 "reproduced": 0}
    )  # fmt: skip

    @property
    def policy(self) -> str:
        """What a step that goes wrong gets: protection's policy, or without protection
        ``cfg.policy`` (the finite-gradient guard's: ``skip_step`` or ``replay``)."""
        return self.handle.config.policy if self.handle is not None else self.cfg.policy

    @classmethod
    def build(cls, cfg: TrainConfig, out: str | Path, *, faults=None) -> TrainState:
        """Set up a run in ``out`` (``out/rank<r>`` for rank r > 0): the process group under
        torchrun, the data, the model (protected, guarded, wrapped in DDP as ``cfg`` says), the
        optimizer and checkpoints; write ``meta.json``; seed the global generator."""
        import transformers

        from attnchecker.models.factory import OwnModel
        from attnchecker.models.protect import protect_
        from attnchecker.recovery.checkpoint import NonTrainableDetector
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
        names = blocks.label_names
        tragedy = names.index("tragedies") if "tragedies" in names else -1
        model = _model(cfg, blocks.vocab_size)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
        sched = None
        if cfg.warmup > 0:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
        handle = None
        if cfg.protect:  # a model of the user's own: one traced forward finds its projections
            own = isinstance(model, OwnModel)
            example = (blocks.batch(0, 1, cfg.seed)[0],) if own else None
            handle = protect_(model, cfg.abft or ABFTConfig(policy="warn"), example=example)
        skips = handle is not None and handle.config.policy in ("skip_step", "replay")
        # the update check (ABFTConfig.invariants) runs in the guard, whatever the policy
        checks_update = handle is not None and "update" in handle.config.invariants
        net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        if cfg.compile:
            net = torch.compile(net)
        if rank != cfg.fault_rank:
            faults = None  # a fault is one node's: the others compute cleanly
        ckpt = (
            _SharedCheckpoints(ckpt_dir, cfg.checkpoint_every, rank, world)
            if cfg.recovery == "checkpoint"
            else None
        )
        meta = {
            "config": cfg.to_dict(),
            "faults": None if faults is None else json.loads(faults.to_json()),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "data": {"texts": len(corpus.texts), "blocks": int(blocks.ids.shape[0]),
                     "vocab": blocks.vocab_size},
        }  # fmt: skip
        (out / "meta.json").write_text(json.dumps(meta, indent=2))
        state = cls(cfg=cfg, out=out, rank=rank, world=world, owns_group=owns_group,
                    blocks=blocks, tragedy=tragedy, model=model, net=net, opt=opt, sched=sched,
                    handle=handle, guarded=guard(opt, handle, names=model)
                    if skips or checks_update else None, faults=faults,
                    detector=NonTrainableDetector(), ckpt=ckpt)  # fmt: skip
        torch.manual_seed(cfg.seed)
        return state


def _model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """The user's model (``cfg.model``: a Python factory or a transformers config) or the
    family preset, in training mode, no KV cache."""
    from attnchecker.models.source import make

    return make(cfg.model or cfg.family, size=cfg.size, task=cfg.task, seed=cfg.seed,
                vocab_size=vocab_size, seq_len=cfg.seq_len, max_len=cfg.seq_len)  # fmt: skip


def train_step(state: TrainState) -> StepResult:
    """Forward and backward of the next step on its batch (each rank its own), the gradient
    norm and the guard's skip flag; under torchrun every rank takes the worst loss and norm, so
    that all decide alike. Read in the step's one host sync; nothing is updated yet."""
    cfg = state.cfg
    x, y = state.blocks.batch(state.step * state.world + state.rank, cfg.batch, cfg.seed)
    labels = x if cfg.task == "lm" else (y == state.tragedy).long()
    low = torch.float16 if cfg.fp16 else torch.bfloat16
    with torch.autocast("cpu", dtype=low, enabled=cfg.bf16 or cfg.fp16):
        loss = state.net(input_ids=x, attention_mask=torch.ones_like(x), labels=labels).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), float("inf"))
    # the guard's skip flag (before the drain that resets it; reduced over the ranks)
    skips = state.handle is not None and state.handle.config.policy in ("skip_step", "replay")
    flag = state.guarded.flag() if state.guarded is not None and skips else torch.zeros(())
    if state.world > 1:  # every rank must take the same decision: share the worst loss
        worst = torch.stack([loss.detach(), grad_norm]).nan_to_num(float("inf"))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        loss, grad_norm = worst[0], worst[1]
    stats = torch.stack([loss.detach().float(), grad_norm.float(), flag.to(loss.device)])
    loss_v, grad_v, skip_v = stats.tolist()  # the step's one host sync
    return StepResult(loss_v, grad_v, bool(skip_v), flag)


def _update_lost(events: list[Event]) -> bool:
    """An optimizer update the update check could not repair (the last step's, settled before
    this step's forward): the parameters are wrong, and only a checkpoint has them right."""
    return any(e.op.startswith("update.") and e.action == "uncorrectable" for e in events)


def _wrong(result: StepResult) -> bool:
    """A step that went wrong: an uncorrectable error, or a non-finite loss or gradient."""
    return result.skip or not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))


def _before(state: TrainState) -> tuple[Any, Any] | None:
    """Under ``policy="replay"``: the random state and the handle's mark (clock and schedule)
    the step starts from, to replay it from."""
    if state.policy != "replay":
        return None
    from attnchecker.recovery.replay import RandomState

    return RandomState.capture(), None if state.handle is None else state.handle.mark()


def _replay(state: TrainState, log: _RunLog, before: tuple[Any, Any]) -> StepResult:
    """The step again, on its batch, from the random state and checks it started with; the
    replay's result (``skip`` when it went wrong again: reproduced)."""
    from attnchecker.recovery.replay import verdict

    rng, mark = before
    first = log.last_events
    state.opt.zero_grad(set_to_none=True)
    rng.restore()
    if mark is not None:
        state.handle.rewind(mark)
    state.totals["replays"] += 1
    again = train_step(state)
    log.step(state, again)
    reproduced = _wrong(again)
    finding, message = verdict(
        first, log.last_events, reproduced=reproduced, checked=state.handle is not None,
        step=state.step + 1, loss=again.loss,
        config=None if state.handle is None else state.handle.config,
    )  # fmt: skip
    log.event({"type": "replay", "step": state.step + 1, "reproduced": reproduced,
               "finding": finding, "message": message})  # fmt: skip
    if not reproduced:
        return again
    state.totals["reproduced"] += 1
    return again._replace(skip=True)


def _skip(state: TrainState, log: _RunLog) -> None:
    """The update is not applied (decided on the host, read with the loss); the step counts as
    done."""
    state.opt.zero_grad(set_to_none=True)
    state.totals["skipped"] += 1
    log.event({"type": "skipped_step", "step": state.step + 1})
    state.step += 1


def _roll_back(state: TrainState, log: _RunLog, status: str) -> None:
    """Back to the last checkpoint (every rank the same one); the steps since are replayed."""
    state.opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    restored = state.ckpt.restore(state.model, state.opt, state.sched)
    state.totals["load_s"] += time.perf_counter() - t0
    state.totals["rollbacks"] += 1
    state.totals["replayed_steps"] += state.step + 1 - restored["step"]
    log.event({"type": "rollback", "at_step": state.step + 1, "to_step": restored["step"],
               "reason": status})  # fmt: skip
    state.step = restored["step"]


def _update(state: TrainState, result: StepResult) -> None:
    """The optimizer step (guarded: it still skips on the device flag) and the schedule."""
    if state.guarded is not None:
        state.guarded.step(flag=result.flag)
    else:
        state.opt.step()
    state.opt.zero_grad(set_to_none=True)
    if state.sched is not None:
        state.sched.step()
    state.step += 1
    state.doubtful = 0
    state.last_loss = result.loss


def _save_checkpoint(state: TrainState) -> None:
    t0 = time.perf_counter()
    state.ckpt.save(state.step, state.model, state.opt, state.sched)
    state.totals["save_s"] += time.perf_counter() - t0
    state.totals["saves"] += 1


class _RunLog:
    """What a run writes as it goes (``metrics.jsonl``: a row per step taken; ``events.jsonl``:
    fired faults, protection events, diagnoses, skips and rollbacks), the progress bar, and the
    tallies the summary reports: protection's counts and this rank's diagnosis counts."""

    def __init__(self, state: TrainState, stack: contextlib.ExitStack, progress: bool) -> None:
        from attnchecker.inject.injector import Injector

        self.inj = (
            stack.enter_context(Injector(state.model, state.faults, optimizer=state.opt,
                                         step_fn=lambda: state.step + 1))
            if state.faults
            else None
        )
        self._metrics = stack.enter_context((state.out / "metrics.jsonl").open("w"))
        self._events = stack.enter_context((state.out / "events.jsonl").open("w"))
        self._bar = stack.enter_context(_bar(state.cfg.steps, progress))
        self.counts = {"detected": 0, "corrected": 0, "uncorrectable": 0}
        self.fired_seen = 0
        self.where = here(next(state.model.parameters()).device)
        self.mine = RankCounts(self.where.rank, self.where.host, self.where.device)
        self._recent: list[float] = []  # the last finite losses: the diagnosis's history
        self.last_events: list[Event] = []  # the last step's drain

    def event(self, row: dict[str, Any]) -> None:
        _write(self._events, row)

    def step(self, state: TrainState, result: StepResult) -> None:
        """The faults fired in this step, protection's events (drained), the step's diagnosis."""
        for r in self.inj.records[self.fired_seen :] if self.inj else []:
            self.event({"type": "fault", **r.to_dict()})
        self.fired_seen = len(self.inj.records) if self.inj else 0
        handle = state.handle
        events = handle.drain() if handle else []
        self.last_events = events
        finding = classify(
            events, step=state.step + 1, loss=result.loss, history=self._recent, where=self.where,
            config=None if handle is None else handle.config,
        )  # fmt: skip
        tally(self.mine, events, finding)
        if finding is not None:
            self.event(finding.to_dict())
        if math.isfinite(result.loss):
            self._recent = [*self._recent[-19:], result.loss]
        for key, n in tally_events(events).items():
            self.counts[key] += n
        for e in events:
            self.event({"type": "protection", **e.to_dict()})

    def metrics(
        self, state: TrainState, result: StepResult, status: str | None, dt: float
    ) -> dict[str, Any]:
        """The metrics row of a step taken (written, and shown on the bar)."""
        # finished_at (unix seconds): how runs advanced in turn interleaved, from files alone
        row = {"step": state.step, "loss": result.loss, "grad_norm": result.grad_norm,
               "step_time_s": dt, "faults_injected": self.fired_seen, "status": status or "ok",
               "finished_at": time.time()}  # fmt: skip
        _write(self._metrics, row)
        self._bar(state.step, result.loss, dt, self.fired_seen, self.counts["corrected"])
        return row


def _finish(state: TrainState, log: _RunLog, *, wall: float) -> dict[str, Any]:
    """Save the weights, gather every rank's counts, end the process group if the run started
    it, and write ``summary.json``."""
    from attnchecker.recovery.checkpoint import save_weights

    save_weights(state.model, state.out / "model.safetensors")
    named = state.handle.devices.candidates() if state.handle is not None else []
    log.mine.quarantine = [r.evidence() for r in named]  # gathered with the counts
    ranks = gather(log.mine)  # every rank's counts (a collective under a process group)
    if state.owns_group:
        # DDP's reducer holds the group and its last gradient all-reduce: left to the
        # interpreter's teardown, gloo's threads can abort a finished rank ("terminate called
        # without an active exception", about 1 run in 25 under load); release them first
        state.net = state.model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    summary = {
        "final_loss": state.last_loss,
        "non_trainable": state.non_trainable,
        "steps_done": state.step,
        "faults_injected": len(log.inj.records) if log.inj else 0,
        "faults_detected": log.counts["detected"],
        "faults_corrected": log.counts["corrected"],
        "uncorrectable": log.counts["uncorrectable"],
        "wall_time_s": wall,
        **state.totals,
        "ranks": [r.to_dict() for r in ranks],
        "outlier_ranks": outliers(ranks),
        "quarantine": [q for r in ranks for q in r.quarantine],
    }
    (state.out / "summary.json").write_text(json.dumps(summary, indent=2))
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
