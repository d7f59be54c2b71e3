"""``measure_costs``: the cost profile of one family on this machine (``attnchecker bench``).

Copies of one model are stepped alternately in one process (forward, backward, AdamW), a few
steps in a row each per round (:func:`alternate`), so drift and bursts of load hit every arm
alike: ``plain`` (what users run: transformers' default SDPA attention; GPT-Neo has none, so
eager), ``engine`` (``protect_`` checking nothing: the checked eager engine instead of SDPA,
kept even though nothing needs it) and one arm per op checking that op in every layer (a core
check on that engine, the others beside the model's own attention, which runs where no core
check is asked); a protected step ends with ``drain()``, as in a training loop. A core op's
cost is the median over rounds of (t_op - t_engine) / t_plain, another op's (t_op - t_plain) /
t_plain, the engine's (t_engine - t_plain) / t_plain, each with the order-statistic interval of
a median. Ops launched per step are counted
(aten ops that launch a kernel on a GPU, eager), and each attention GEMM's multiply-adds per
step are read from the shapes at its sites: the exposure of that site to faults that arrive per
element operation.
"""

from __future__ import annotations

import contextlib
import copy
import math
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from attnchecker.adaptive.profile import ENGINE, RECOVERY_ARMS, CostProfile, Estimate, OpCost
from attnchecker.attention.config import ALL_OPS, LINEAR_OPS, OPS, ABFTConfig
from attnchecker.attention.ops import CORE_OPS, linear_parts
from attnchecker.errors import ConfigError

__all__ = ["alternate", "measure_costs", "median_interval", "stepper"]

DTYPES = ("fp32", "bf16")
PER_ROUND = 3  # timed steps in a row per arm and round


def median_interval(xs: list[float], confidence: float = 0.95) -> Estimate:
    """The median of ``xs`` and the distribution-free interval of a median from order
    statistics: [x_(j), x_(n+1-j)] with P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2."""
    xs = sorted(xs)
    n = len(xs)
    cdf, j = 0.0, 0
    while j < n // 2 and cdf + math.comb(n, j) / 2**n <= (1 - confidence) / 2:
        cdf += math.comb(n, j) / 2**n
        j += 1
    j = max(j, 1)
    return Estimate(statistics.median(xs), xs[j - 1], xs[n - j])


def _models(family: str, size: str, seq_len: int, layers: int | None, seed: int, device: str):
    from attnchecker.models.source import make, plain

    base = make(family, size=size, seed=seed, seq_len=seq_len, layers=layers)
    return base.to(device), plain(base).to(device)


def stepper(model, run, inputs, dtype: str, device: str, wrap: Callable | None = None,
            fused: bool = False):  # fmt: skip
    """One training step of ``model`` (forward through ``run``), as a closure; ``wrap`` wraps
    its optimizer (a guard); ``fused``: AdamW's fused kernel."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    opt = opt if wrap is None else wrap(opt)
    cast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else None
    handle = getattr(model, "_attnchecker_handle", None)

    def step() -> None:
        with cast or contextlib.nullcontext():
            loss = run(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if handle is not None:
            handle.drain()  # a protected step reads its records once, as training loops do

    return step


def replay_stepper(model, inputs, dtype: str, device: str, handle=None):
    """One training step of ``model`` under :func:`attnchecker.replay` (``handle``: its
    protection, or None for the finite-gradient guard alone), as a closure: what a clean step
    costs with the test, the drain and the one host read a replay needs."""
    from attnchecker.recovery.replay import Replayer

    opt = Replayer(torch.optim.AdamW(model.parameters(), lr=1e-5), handle)
    cast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else None

    def closure():
        with cast or contextlib.nullcontext():
            loss = model(**inputs).loss
        loss.backward()
        return loss

    def step() -> None:
        opt.step(closure)
        opt.zero_grad(set_to_none=True)

    return step


def alternate(
    steps: dict[str, Callable[[], None]],
    reps: int,
    per_round: int = PER_ROUND,
    *,
    warm: int = 1,
    sync: Callable[[], None] = lambda: None,
    advance: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds per round of each arm: rounds alternate the arms; in a round an arm runs
    ``warm`` untimed steps then ``per_round`` timed ones in a row, so its caches are as warm as
    in a training loop (stepping many models one step each measures cold steps, and the plain
    model's cold step hides the checks' overhead)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, f in steps.items():
            for _ in range(warm):
                f()
            sync()
            t0 = time.perf_counter()
            for _ in range(per_round):
                f()
            sync()
            times[k].append(time.perf_counter() - t0)
        advance()
    return times


def _site_macs(handle, model, step) -> dict[tuple[int, str], int]:
    """Multiply-adds per step of every attention GEMM (and the softmax's elements), from the
    output shapes at the forward sites of one step (a backward GEMM has its forward's size)."""
    shapes: dict[tuple[str, str], torch.Size] = {}

    def seen(call) -> None:
        if not call.replay:
            shapes.setdefault((call.module, call.site), call.tensor.shape)

    detach = handle.attach(seen, sites=OPS)
    step()
    detach.remove()
    out: dict[tuple[int, str], int] = defaultdict(int)
    for name in handle.modules:
        st = handle.state(name)
        sh = {s: shapes[(name, s)] for s in OPS if (name, s) in shapes}
        if len(sh) < len(OPS):
            continue
        n = {s: math.prod(v) for s, v in sh.items()}
        hidden, d, Lk, inner = sh["out"][-1], sh["context"][-1], sh["scores"][-1], sh["q"][-1]
        fwd = {"q": n["q"] * hidden, "k": n["k"] * hidden, "v": n["v"] * hidden,
               "scores": n["scores"] * d, "probs": n["probs"], "context": n["context"] * Lk,
               "out": n["out"] * inner}  # fmt: skip
        fused = "dx.k" not in st.hooks  # one Q|K|V GEMM: its gradients under dx.q, dw.q
        qkv = fwd["q"] + fwd["k"] + fwd["v"]
        grads = {"dq": fwd["scores"], "dk": fwd["scores"], "dp": fwd["context"],
                 "dv": fwd["context"], "dx.out": fwd["out"], "dw.out": fwd["out"]}  # fmt: skip
        for s in ("q", "k", "v"):
            if f"dx.{s}" in st.hooks:
                grads[f"dx.{s}"] = grads[f"dw.{s}"] = qkv if fused else fwd[s]
        for op, m in {**fwd, **grads}.items():
            out[(st.layer, op)] += m
    return dict(out)


def _linears(model, handle, roles: set[str]) -> dict[tuple[int, str], nn.Module]:
    """The model's linear layers of ``roles`` outside attention by (layer, role)."""
    from attnchecker.models.registry import linear_by_role

    attention = [n for n in handle.modules if "y" not in handle.state(n).hooks]
    return {key: m for key, (n, m) in linear_by_role(model, roles).items()
            if not any(n.startswith(a + ".") for a in attention)}  # fmt: skip


def _arm_config(op: str, linears: dict[tuple[int, str], nn.Module]) -> ABFTConfig:
    """One op checked in every layer: an attention op, or a linear layer's check in every
    block that has the layer (``scope="all_linear"``, a schedule naming only it)."""
    parts = linear_parts(op)
    if parts is None:
        return ABFTConfig(ops=(op,), backend=ENGINE)
    entries = tuple((layer, op, 1) for layer, role in linears if role == parts[0])
    return ABFTConfig(scope="all_linear", schedule=entries, backend=ENGINE)


def _linear_macs(linears: dict[tuple[int, str], nn.Module], tokens: int,
                 ops: set[str]) -> dict[tuple[int, str], int]:  # fmt: skip
    """Multiply-adds per step of each linear check in ``ops``: the forward's and each backward
    GEMM's are one size, tokens x in x out."""
    out = {}
    for (layer, role), m in linears.items():
        for op in ops:
            if linear_parts(op)[0] == role:
                out[(layer, op)] = tokens * m.weight.numel()
    return out


def _step_macs(model, step) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() // 2


def _on_engine(handle):
    """``handle``'s attention modules kept on the checked core even where nothing needs it
    (protection otherwise runs the model's own attention when no core op is checked): every
    arm is priced on :data:`ENGINE`, the engine a plan pins."""
    for name in handle.modules:
        handle.state(name).keep_core = True
    return handle


def measure_costs(
    family: str,
    *,
    size: str = "tiny",
    batch: int = 4,
    seq_len: int = 32,
    layers: int | None = None,
    compile: bool = False,
    dtype: str = "fp32",
    device: str = "cpu",
    reps: int = 9,
    warmup: int = 2,
    seed: int = 0,
    ops: tuple[str, ...] = ALL_OPS,
    progress: bool = False,
) -> CostProfile:
    """The cost profile of ``family`` (a family at a preset ``size``, or the user's own model:
    :func:`~attnchecker.models.source.make`; random weights, token batches of ``batch`` x
    ``seq_len``) on ``device``: see the module docstring."""
    from attnchecker.inject.campaign import Progress
    from attnchecker.models import source
    from attnchecker.models.protect import protect_
    from attnchecker.models.registry import linear_layers
    from attnchecker.testing import count_ops

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if reps < 3:
        raise ConfigError(f"reps must be >= 3 for a median and its interval, got {reps}")
    if unknown := sorted(op for op in set(ops) - set(ALL_OPS) if not linear_parts(op)):
        raise ConfigError(f"unknown ops {unknown}; choose from {list(ALL_OPS)} or a linear "
                          f"layer's role:op (mlp.c_fc:y, op of {list(LINEAR_OPS)})")  # fmt: skip
    base, plain = _models(family, size, seq_len, layers, seed, device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, seq_len), generator=g).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    example = source.example(base, ids)  # a model of the user's own: traced once
    engine = copy.deepcopy(base)
    handle = _on_engine(protect_(engine, ABFTConfig(ops=(), backend=ENGINE), example=example))
    wired = {s for name in handle.modules for s in handle.state(name).hooks}
    # (layer, role) -> the linear layer outside attention of each linear check asked for
    linears = _linears(base, handle, {p[0] for op in ops if (p := linear_parts(op))})
    if missing := sorted(op for op in ops if (p := linear_parts(op)) and
                         p[0] not in {role for _, role in linears}):  # fmt: skip
        roles = sorted({role for *_, role in linear_layers(base)})
        raise ConfigError(f"no linear layer of the roles of {missing} outside attention in the "
                          f"model; its linear layers' roles: {roles}")  # fmt: skip
    checked = [op for op in ops if op in wired or linear_parts(op)]  # a fused Q|K|V: no dx.k
    arms = {"plain": plain, "engine": engine}
    for op in checked:
        arms[op] = copy.deepcopy(base)
        h = protect_(arms[op], _arm_config(op, linears), example=example)
        if op in CORE_OPS:  # a core check runs on the engine; the others beside SDPA
            _on_engine(h)
    runs = {k: torch.compile(m) if compile else m for k, m in arms.items()}
    steps = {k: stepper(arms[k], runs[k], inputs, dtype, device) for k in arms}
    if not compile:  # the recovery arms (CostProfile.recovery), as users run them
        guarded = copy.deepcopy(plain)
        default = copy.deepcopy(base)
        h = protect_(default, ABFTConfig(policy="replay", backend=ENGINE), example=example)
        steps["guard"] = replay_stepper(guarded, inputs, dtype, device)
        steps["abft"] = replay_stepper(default, inputs, dtype, device, h)
    eager_steps = (  # launches and sizes are counted in eager
        {k: stepper(arms[k], arms[k], inputs, dtype, device) for k in arms} if compile else steps
    )
    launches = {k: count_ops(eager_steps[k]).launching for k in arms}
    macs = _site_macs(handle, engine, eager_steps["engine"])
    macs |= _linear_macs(linears, batch * seq_len, {op for op in checked if linear_parts(op)})
    step_macs = _step_macs(plain, eager_steps["plain"])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):  # compiles here, when compiling
        for f in steps.values():
            f()
    with Progress(reps, progress) as advance:
        times = alternate(steps, reps, sync=sync, advance=advance)
    plain_t, engine_t = times["plain"], times["engine"]

    def base(op: str) -> str:  # what a check is added to: the engine (core), else SDPA
        return "engine" if op in CORE_OPS else "plain"

    def share(op: str) -> list[float]:  # (t_op - t_base) / t_plain per round
        b = times[base(op)]
        return [(a - e) / p for a, e, p in zip(times[op], b, plain_t, strict=True)]

    recovery = {k: median_interval([(a - p) / p for a, p in zip(times[k], plain_t, strict=True)])
                for k in RECOVERY_ARMS if k in times}  # fmt: skip
    op_costs = tuple(
        OpCost(op, median_interval(share(op)), launches[op] - launches[base(op)]) for op in checked
    )
    n_layers = len({layer for layer, op in macs if not linear_parts(op)})
    return CostProfile(
        family=family,
        setup={"size": size, "batch": batch, "seq_len": seq_len, "layers": n_layers,
               "compile": compile, "dtype": dtype, "device": device, "reps": reps, "seed": seed,
               "engine": ENGINE},
        step_seconds=statistics.median(plain_t) / PER_ROUND,
        engine=median_interval([(e - p) / p for e, p in zip(engine_t, plain_t, strict=True)]),
        engine_launches=launches["engine"] - launches["plain"],
        ops=op_costs,
        macs=tuple((layer, op, m) for (layer, op), m in sorted(macs.items())),
        step_macs=step_macs,
        host={"machine": platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "threads": torch.get_num_threads()},
        recovery=recovery,
    )  # fmt: skip
