"""torchtitan's model converter ``"attnchecker"``: protection with three lines of a job's TOML.

    [job]
    custom_config_module = "attnchecker.integrations.torchtitan"   # this module: [attnchecker]
    [model]
    converters = ["attnchecker"]
    [attnchecker]                                                   # optional, these defaults
    scope = "attention"        # or "all_linear": every linear layer too
    backend = "auto"           # the SDPA route on CUDA, the eager engine on a CPU
    policy = "skip_step"       # skip_step | raise | warn (replay skips: see below)

torchtitan imports ``custom_config_module`` while it parses the job, which registers the
converter (``torchtitan.protocols.model_converter``) and adds the ``[attnchecker]`` section
(``--attnchecker.policy raise`` on its command line). Its trainer then:

1. builds the model on the meta device and calls :meth:`AttnCheckerConverter.convert`, which
   protects it there (a traced forward on a meta batch of the job's shape finds the SDPA calls
   and their projections; no memory, no values), *before* tensor parallelism, activation
   checkpointing, per-block compile and FSDP wrap it. Protection is hooks on the same modules,
   so it survives all four; a tensor-parallel layer is checked on its local shard
   (:mod:`attnchecker.attention.sharded`).
2. steps the optimizer: under ``skip_step`` each optimizer is guarded
   (:func:`attnchecker.guard`, rerouted at its first step by a torch.optim step pre-hook): the
   uncorrectable flag is max-reduced over the default process group (the whole mesh: one
   all-reduce of one float a step, the only communication the checks add) and the update is
   skipped on the device, on every rank alike. Learning-rate schedulers still advance.
   ``raise`` and ``warn`` drain before the update, so ``raise`` stops before a bad one.
3. calls :meth:`AttnCheckerConverter.post_optimizer_hook` after each step: the events are
   drained (one host read a step), logged through torchtitan's logger with this rank and its
   mesh coordinates, and kept in :attr:`AttnCheckerConverter.events`.

torchtitan's trainer needs CUDA (its device is ``cuda:<LOCAL_RANK>``): on a CPU the same
converter and the same ``parallelize_llama`` are driven by a loop of one's own, as the tests
do (``tests/integration/test_torchtitan_parallel.py``). ``docs/torchtitan.md`` says what is
checked under each parallelism.
"""

# (no `from __future__ import annotations`: tyro, which parses torchtitan's job, resolves these
# dataclasses' field types in torchtitan's namespace, where strings would not name them)
import dataclasses
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from attnchecker.attention.config import ABFTConfig
from attnchecker.errors import ConfigError

__all__ = ["AttnChecker", "AttnCheckerConverter", "JobConfig"]

_LOG = logging.getLogger("attnchecker")

NAME = "attnchecker"


@dataclass
class AttnChecker:
    """The ``[attnchecker]`` section of a torchtitan job: :class:`ABFTConfig`'s fields that a
    job sets (the rest keep their defaults)."""

    scope: str = "attention"
    """attention: its GEMMs, forward and backward; all_linear: every linear layer too"""
    backend: str = "auto"
    """auto (the SDPA route on CUDA), sdpa, triton or eager"""
    policy: str = "skip_step"
    """on an uncorrectable error: skip_step (every rank), raise, warn; replay skips"""
    check_impl: str = "auto"
    """how the GEMM checks run: auto, eager, triton, accumulator"""
    tolerance_scale: float = 1.0
    """multiplies every check's rounding bound"""
    max_rows: int = 4
    """rows (tokens) a check repairs; more is uncorrectable"""
    max_heads: int = 2
    """heads of the core a check recomputes; more is uncorrectable"""
    report_every: int = 0
    """every this many steps, rank 0 logs the ranks whose faults stand out (one all-gather of
    each rank's counts); 0: torchtitan's metrics.log_freq"""

    def abft_config(self) -> ABFTConfig:
        """The :class:`ABFTConfig` this section asks for (its errors name the TOML key)."""
        fields = dataclasses.asdict(self)
        every = fields.pop("report_every")
        if every < 0:
            raise ConfigError(f"[attnchecker] report_every must be >= 0, got {every}")
        try:
            return ABFTConfig(**fields)
        except ConfigError as e:
            raise ConfigError(f"[attnchecker] in the torchtitan job: {e}") from e


@dataclass
class JobConfig:
    """What torchtitan merges into its ``JobConfig`` (``job.custom_config_module``)."""

    attnchecker: AttnChecker = field(default_factory=AttnChecker)


def _refuse_unsupported(job: Any, dims: Any) -> None:
    """What the converter cannot protect yet, refused by name before anything is built."""
    why = []
    ac = getattr(job, "activation_checkpoint", None)
    mode = getattr(ac, "mode", "none")
    compiled = getattr(job, "compile", None)
    compiled = bool(getattr(compiled, "enable", False)) and "model" in compiled.components
    if mode == "selective" and getattr(ac, "selective_ac_option", "") == "op":
        why.append(
            "op-level selective activation checkpointing (the checks' own ops make the "
            "recomputed forward's op sequence differ from the first: use mode 'full' or a "
            "layer count, selective_ac_option = '2')"
        )
    elif mode != "none" and compiled:
        why.append(
            f"activation checkpointing ({mode}) with per-block compile (the checks keep their "
            f"records outside the checkpointed region, a side effect torch.compile's checkpoint "
            f"operator refuses: turn one of them off)"
        )
    for name, what in (("cp", "context parallelism"), ("pp", "pipeline parallelism")):
        if getattr(dims, name, 1) > 1:
            why.append(f"{what} ({name} = {getattr(dims, name)})")
    if why:
        raise ConfigError(
            f"attnchecker's torchtitan converter does not support {'; '.join(why)}; "
            f"docs/torchtitan.md says what is checked under each parallelism"
        )


def _coordinates(parallel_dims: Any) -> dict[str, int]:
    """This rank's coordinate on each parallel dimension of degree > 1 (``{"fsdp": 1, "tp":
    0}``), as torchtitan names them; {} without a mesh."""
    out = {}
    for name in ("pp", "dp_replicate", "fsdp", "cp", "tp"):
        try:
            mesh = parallel_dims.get_mesh(name)
        except (AttributeError, KeyError, ValueError, RuntimeError):
            continue
        if mesh is not None and mesh.size() > 1:
            out[name] = mesh.get_local_rank()
    return out


class AttnCheckerConverter:
    """torchtitan's ``ModelConverter`` protocol: :meth:`convert` before parallelization,
    :meth:`post_optimizer_hook` after each optimizer step (module docstring)."""

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        section = getattr(job_config, NAME, None) or AttnChecker()
        if isinstance(section, dict):  # (a JobConfig without this module's dataclass)
            section = AttnChecker(**section)
        self.config = section.abft_config()
        _refuse_unsupported(job_config, parallel_dims)
        metrics = getattr(job_config, "metrics", None)
        self.report_every = section.report_every or getattr(metrics, "log_freq", 10)
        training = job_config.training
        self.batch = (training.local_batch_size, training.seq_len)
        self.parallel_dims = parallel_dims
        self.handle: Any = None
        self.events: list[dict[str, Any]] = []  # every event drained, with rank and mesh
        self.guarded: list[Any] = []  # the guarded optimizers (GuardedOptimizer)
        self._model: nn.Module | None = None
        self._ours: set[int] | None = None  # ids of the model's parameters, once parallelized
        self._hook: Any = None
        self._rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._where: dict[str, int] | None = None
        self._inner: set[int] = set()  # ids of the optimizers a container steps
        self.counts: Any = None  # this rank's RankCounts (recovery.diagnosis), from the first step
        self.outliers: list[str] = []  # the last report's ranks that stand out (on every rank)

    # -- the protocol

    def convert(self, model: nn.Module) -> None:
        """Protect ``model`` in place: on the meta device (torchtitan builds it there) by a
        traced forward on a meta batch of the job's (local batch, sequence) shape; a model
        with values is protected at its first forward."""
        from attnchecker.models.protect import protect_

        first = next(model.parameters(), None)
        example = None
        if first is not None and first.is_meta:
            example = (torch.zeros(self.batch, dtype=torch.long, device="meta"),)
        self.handle = protect_(model, self.config, example=example)
        self._model = model
        if self.config.policy == "replay":
            _LOG.warning(
                "attnchecker: policy='replay' skips the step under torchtitan (a converter "
                "does not hold the batches to replay them)"
            )
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        me = weakref.ref(self)  # (the process's hook must not keep a finished run alive)

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            converter = me()
            if converter is not None:
                converter._before_step(optimizer, args, kwargs)

        self._hook = register_optimizer_step_pre_hook(before_step)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """After each optimizer step: under ``skip_step`` the events are drained here (the
        guarded step has read the flag on the device)."""
        if self.guarded:
            self._drain()

    # -- the step

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._ours is None:  # read at the first step: FSDP and TP replace the Parameters
            self._ours = {id(p) for p in self._model.parameters()}
        return any(id(p) in self._ours for g in optimizer.param_groups for p in g["params"])

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A torch.optim step pre-hook (every optimizer of the process): the first step of an
        optimizer of this model, or of torchtitan's container of them, reroutes it through the
        guard; under ``raise`` / ``warn`` the events are drained here, before the update."""
        if getattr(optimizer, "_attnchecker_guarded", False) or id(optimizer) in self._inner:
            return  # (the guarded step calling its own; an optimizer its container stepped)
        inner = getattr(optimizer, "optimizers", None)  # torchtitan's OptimizersContainer
        if inner is not None:
            self._inner.update(id(o) for o in inner)
        mine = [o for o in (optimizer,) if inner is None and self._owns(o)]
        mine += [o for o in inner or () if self._owns(o)]
        if not mine:
            return
        if self.config.policy not in ("skip_step", "replay"):
            self._drain()  # raise raises here, before a bad update
            return
        for o in mine:
            if not getattr(o, "_attnchecker_guarded", False):
                self._reroute(o)
                if o is optimizer:  # its own step is running: too late to reroute this one
                    self._skip_now(o)

    def _reroute(self, optimizer: torch.optim.Optimizer) -> None:
        from attnchecker.recovery.guard import guard

        guarded = guard(optimizer, self.handle)  # keeps optimizer.step as bound now
        optimizer._attnchecker_guarded = True

        def step(closure: Any = None) -> Any:
            return guarded.step(closure)

        optimizer.step = step
        self.guarded.append(guarded)

    def _skip_now(self, optimizer: torch.optim.Optimizer) -> None:
        """The step already running when its optimizer was first seen (no container stepped
        it): the flag, reduced over the mesh, read on the host once; a set flag leaves every
        gradient None, which every torch optimizer skips."""
        guarded = self.guarded[-1]
        flag = guarded.flag()
        if bool(flag):
            for g in optimizer.param_groups:
                for p in g["params"]:
                    p.grad = None
            guarded.skipped = flag.new_ones(())

    def _drain(self) -> None:
        from attnchecker.recovery.diagnosis import (
            RankCounts,
            classify,
            gather,
            here,
            outliers,
            tally,
        )

        if self._where is None:
            self._where = _coordinates(self.parallel_dims)
            at = here(self.handle._clock.count.device)
            self.counts = RankCounts(at.rank, at.host, at.device)
        events = self.handle.drain()
        step = self.counts.steps + 1
        tally(self.counts, events, classify(events, step=step, config=self.config))
        if step % self.report_every == 0:  # one all-gather of small dicts, every N steps
            self.outliers = outliers(gather(self.counts))
            if self._rank == 0 and self.outliers:
                _LOG.warning("attnchecker: step %d: ranks that stand out: %s", step,
                             "; ".join(self.outliers))  # fmt: skip
        for e in events:
            record = {**e.to_dict(), "rank": self._rank, "mesh": dict(self._where)}
            self.events.append(record)
            mesh = " ".join(f"{k} {v}" for k, v in self._where.items())
            _LOG.warning(
                "attnchecker: rank %d (%s) step %d: %s %s %s (%s, %s)",
                self._rank, mesh or "one process", e.step, e.module, e.op, e.action,
                e.pattern, e.kind,
            )  # fmt: skip

    @property
    def skipped_steps(self) -> int:
        """Steps the guard skipped on this rank (a device read)."""
        return sum(int(g.skipped) for g in self.guarded if g.skipped is not None)

    def close(self) -> None:
        """Remove the optimizer hook and the protection (the end of a run of one's own)."""
        from attnchecker.models.protect import unprotect_

        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._model is not None:
            unprotect_(self._model)
            self._model = None


def _register() -> None:
    from torchtitan.protocols.model_converter import (
        _registry_model_converter_cls,
        register_model_converter,
    )

    if NAME not in _registry_model_converter_cls:
        register_model_converter(AttnCheckerConverter, NAME)


_register()
