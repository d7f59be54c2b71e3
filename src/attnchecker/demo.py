"""``attnchecker demo``: extreme errors land in an attention GEMM and are located and corrected.

A real, short demonstration of the math core on an attention-shaped product
AS = Q K^T, (B, nh, L, d) @ (B, nh, d, L): each scenario corrupts the product between the
multiply and the verification, then shows what the checksums found and what they repaired,
against the fault-free product. A last check shows that the gradients through a corrected
product equal the fault-free gradients. :func:`run_demo` runs it and the other three parts
(a protected model, the diagnosis, the training demo) and says which fell short of its claim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

from attnchecker.abft import Pattern, ValueKind, protected_matmul
from attnchecker.attention.state import SiteCall
from attnchecker.inject import exponent_flip

__all__ = ["BACKENDS", "run_demo", "run_math_demo"]

B, NH, L, D = 2, 4, 128, 64
BACKENDS = ("eager", "sdpa", "triton")  # the model demo's: a named engine ("auto" hides which)


@dataclass(frozen=True)
class _Scenario:
    name: str
    corrupt: Callable[[Tensor], None]
    at: tuple[int, int, int, int]  # (b, h, q, k): the element whose values are printed


def _set(index: tuple, value: float | Callable[[Tensor], Tensor]) -> Callable[[Tensor], None]:
    def corrupt(c: Tensor) -> None:
        c[index] = value(c[index]) if callable(value) else value

    return corrupt


_SCENARIOS = (
    _Scenario("INF, one element", _set((1, 2, 17, 90), float("inf")), (1, 2, 17, 90)),
    _Scenario("NaN, one element", _set((0, 3, 127, 0), float("nan")), (0, 3, 127, 0)),
    _Scenario("near-INF 1e10, one element", _set((1, 0, 64, 127), 1e10), (1, 0, 64, 127)),
    _Scenario("exponent bit flip", _set((0, 1, 5, 6), exponent_flip), (0, 1, 5, 6)),
    _Scenario("INF across a row (Q fault)", _set((1, 1, 40), float("inf")), (1, 1, 40, 3)),
    _Scenario(
        "NaN down a column (K fault)", _set((0, 2, slice(None), 77), float("nan")), (0, 2, 9, 77)
    ),
    _Scenario("2D block of 1e10", _set((1, 3, slice(3, 6), slice(8, 11)), 1e10), (1, 3, 4, 9)),
)


def run_math_demo(console: Console | None = None, seed: int = 0) -> list[dict[str, object]]:
    """Run every scenario, print a table, return one record per scenario."""
    console = console or Console(width=max(Console().width, 132))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, L, D, generator=g, requires_grad=True)
    k = torch.randn(B, NH, L, D, generator=g, requires_grad=True)
    clean = (q @ k.mT).detach()  # (B, nh, L, L)
    console.print(
        f"[bold]attnchecker math core[/]: AS = Q K^T with Q, K of shape {tuple(q.shape)} (fp32); "
        "each fault lands in AS after the multiply, before the check."
    )
    table = Table(show_lines=False)
    cols = (
        "fault",
        "pattern",
        "value",
        "found at",
        "delivered",
        "corrected",
        "fault-free",
        "max|err|",
        "result",
    )
    for col in cols:
        table.add_column(
            col, justify="left" if col in ("fault", "result") else "right", no_wrap=True
        )
    records = []
    for sc in _SCENARIOS:
        delivered: dict[str, float] = {}

        def corrupt(c: Tensor, sc: _Scenario = sc, seen: dict[str, float] = delivered) -> None:
            sc.corrupt(c)
            seen["v"] = float(c[sc.at])

        with torch.no_grad():
            c, rep = protected_matmul(q, k.mT, corrupt=corrupt)
        b, h = sc.at[:2]
        ok = bool(rep.corrected[b, h])
        err = float((c - clean).abs().max())
        rec = {
            "scenario": sc.name,
            "pattern": Pattern(int(rep.pattern[b, h])).name,
            "kind": ValueKind(int(rep.kind[b, h])).name,
            "located": (int(rep.row[b, h]), int(rep.col[b, h])),
            "delivered": delivered["v"],
            "corrected": float(c[sc.at]),
            "fault_free": float(clean[sc.at]),
            "max_abs_error": err,
            "status": "corrected" if ok else ("flagged" if bool(rep.detected[b, h]) else "missed"),
        }
        records.append(rec)
        table.add_row(
            sc.name,
            rec["pattern"],
            rec["kind"].lower(),
            str(rec["located"]),
            f"{rec['delivered']:.4g}",
            f"{rec['corrected']:.5g}",
            f"{rec['fault_free']:.5g}",
            f"{err:.2g}",
            ("[green]" if ok else "[yellow]") + str(rec["status"]),
        )
    console.print(table)
    console.print(
        "pattern: D0 one element, R1 a whole row, C1 a whole column, D2 several rows and columns. "
        "A D2 block is beyond what checksums can repair: it is flagged uncorrectable and left as "
        "delivered, never silently mis-corrected (protected attention escalates by recomputing)."
    )
    records.append(_gradient_check(q, k, console))
    return records


def _gradient_check(q: Tensor, k: Tensor, console: Console) -> dict[str, object]:
    def loss(corrupt: Callable[[Tensor], None] | None) -> Tensor:
        c, _ = protected_matmul(q, k.mT, corrupt=corrupt)
        return (c / D**0.5).softmax(-1).square().sum()

    l0 = loss(None)
    g0 = torch.autograd.grad(l0, (q, k))
    l1 = loss(_set((1, 2, slice(None), 31), float("nan")))
    g1 = torch.autograd.grad(l1, (q, k))
    diff = max(float((x - y).abs().max()) for x, y in zip(g0, g1, strict=True))
    console.print(
        f"Gradients through softmax(AS) with a NaN column corrected: loss {l1.item():.6f} vs "
        f"fault-free {l0.item():.6f}; max |grad difference| over Q and K = {diff:.2g}."
    )
    return {
        "scenario": "gradient",
        "loss": l1.item(),
        "loss_fault_free": l0.item(),
        "max_grad_diff": diff,
    }


_MODEL_FAULTS = (
    ("INF in one score", "scores", lambda t: t[0, 1, 5, 3].fill_(float("inf"))),
    ("NaN across a K row", "k", lambda t: t[1, 7].fill_(float("nan"))),
    ("1e10 down a context column", "context", lambda t: t[0, 2, :, 4].fill_(1e10)),
    (
        "exponent flip in the output projection",
        "out",
        lambda t: t[0, 5, 20].copy_(exponent_flip(t[0, 5, 20])),
    ),
    (
        "2D block of NaN in the probabilities",
        "probs",
        lambda t: t[1, 0, 2:6, 1:5].fill_(float("nan")),
    ),
)


def _fused_faults():
    """The model demo's faults on the fused backend: inside the kernels' GEMMs, forward and
    backward, and in the projections, which keep their checks."""
    from attnchecker.kernels.flash import KernelFault

    return (
        ("INF in one score (S tile)", "kernel:s", KernelFault("s", 0, 1, 5, 3, float("inf"))),
        ("NaN across a K row", "k", _MODEL_FAULTS[1][2]),
        ("1e10 in the P V accumulator", "kernel:pv", KernelFault("pv", 0, 2, 7, 4, 1e10)),
        ("exponent flip in dQ (backward)", "kernel:dq",
         KernelFault("dq", 1, 0, 9, 5, mode="exponent")),
        ("NaN down a dV column (backward)", "kernel:dv",
         KernelFault("dv", 0, 3, -1, 6, float("nan"))),
        _MODEL_FAULTS[3],
    )  # fmt: skip


def run_model_demo(
    console: Console | None = None, family: str = "gpt2", seed: int = 0, backend: str = "eager"
) -> list[dict[str, object]]:
    """One AdamW training step of a small model per fault, unprotected and protected, against
    the fault-free step; prints a table and returns one record per fault. ``backend="triton"``:
    the fused kernels (dropout off, so that they run every call), faults inside them."""
    import copy

    from attnchecker import ABFTConfig, protect_
    from attnchecker.models.tiny import build

    console = console or Console(width=max(Console().width, 132))
    torch.manual_seed(seed)
    base = build(family, "small", max_len=64, seed=seed)
    base.train()
    faults = _fused_faults() if backend == "triton" else _MODEL_FAULTS
    if backend == "triton":  # (attention dropout in training runs the checked eager attention)
        for m in base.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(seed))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step(model: torch.nn.Module) -> tuple[float, dict[str, Tensor], dict[str, Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(seed + 1)
        loss = model(**inputs).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        return loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}

    def diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    def protected(config: ABFTConfig) -> tuple[torch.nn.Module, object]:
        model = copy.deepcopy(base)
        return model, protect_(model, config.replace(backend=backend))

    loss0, grads0, params0 = step(protected(ABFTConfig(ops=()))[0])
    console.print(
        f"\n[bold]protect_(model)[/]: one training step of a {family} model (hidden 256, 4 layers) "
        f"per fault, landing in layer 0 ({backend} backend); fault-free loss {loss0:.6f}."
    )
    table = Table()
    cols = ("fault", "site", "unprotected loss", "|param diff|", "protected loss", "|grad diff|")
    for col in (*cols, "events"):
        table.add_column(
            col, justify="left" if col in ("fault", "events") else "right", no_wrap=True
        )
    records = []
    for name, site, edit in faults:
        row: dict[str, object] = {"fault": name, "site": site}
        for arm, config in (("unprotected", ABFTConfig(ops=())), ("protected", ABFTConfig())):
            model, handle = protected(config)
            if site.startswith("kernel:"):
                first = handle.modules[0]  # layer 0
                handle.state(first).kernel_fault = edit
            else:

                def fault(c: SiteCall, site: str = site, edit: Callable = edit) -> None:
                    if c.site == site and c.layer == 0:
                        edit(c.tensor)

                handle.attach(fault)
            loss, grads, params = step(model)
            row[f"{arm}_loss"] = loss
            row[f"{arm}_grad_diff"] = diff(grads, grads0)
            row[f"{arm}_param_diff"] = diff(params, params0)
            row[f"{arm}_events"] = [
                f"{e.op} {e.pattern} {e.kind} {e.action}" for e in handle.drain()
            ]
        records.append(row)
        table.add_row(
            name,
            site,
            f"{row['unprotected_loss']:.6f}",
            f"{row['unprotected_param_diff']:.1e}",
            f"{row['protected_loss']:.6f}",
            f"{row['protected_grad_diff']:.1e}",
            "; ".join(row["protected_events"]),
        )
    console.print(table)
    console.print(
        "Unprotected, every fault reaches the loss or the weights. Protected, the loss equals "
        "the fault-free one and gradients agree to rounding (a repaired value comes from a "
        "smaller GEMM, which sums in another order); AdamW's first step divides by |grad|, "
        "which can magnify that rounding on near-zero gradients to ~1e-4 in the parameters. "
        "|diff| = max abs difference from the fault-free step over all parameters."
    )
    return records


def _median_step(run) -> float:
    """Median step time of a run directory's metrics (seconds)."""
    import statistics

    from attnchecker.report.training import read_metrics

    rows = read_metrics(run)
    return statistics.median(r["step_time_s"] for r in rows) if rows else float("nan")


def demo_plan(steps: int):
    """The demo's seeded faults: an INF, a NaN column and a near-INF, spread over the run."""
    from attnchecker.inject import FaultPlan

    return (
        FaultPlan.builder(seed=1)
        .at(max(2, steps // 4)).site("scores", layer=0).kind("inf").add()
        .at(max(3, steps // 2)).site("context", layer=1).kind("nan").pattern("1C").add()
        .at(max(4, 3 * steps // 4)).site("q", layer=0).kind("near_inf").pattern("1R").add()
        .build()
    )  # fmt: skip


class _Turns:
    """One arm's training (:func:`~attnchecker.train.loop.train_steps`), a step per call; once
    it has finished a call does nothing, so that the other arms go on taking turns."""

    def __init__(self, run) -> None:
        self._run = run
        self.summary: dict[str, object] | None = None

    @property
    def done(self) -> bool:
        return self.summary is not None

    def __call__(self) -> None:
        if self.summary is None:
            try:
                next(self._run)
            except StopIteration as stop:
                self.summary = stop.value


def _training(runs: dict[str, _Turns]) -> set[str]:
    return {arm for arm, run in runs.items() if not run.done}


def _overheads(times: dict[str, list[float]], live: list[set[str]]) -> dict[str, tuple]:
    """Each arm's overhead over the reference, from the rounds that both ran through (``live``:
    the arms still training after each round): the median over those rounds of
    t_arm / t_reference - 1 with the order-statistic interval of a median (the range below 6
    rounds), and the number of rounds; ``(None, n)`` below 2 rounds (no interval)."""
    from attnchecker.adaptive.bench import median_interval

    out = {}
    for arm, ts in times.items():
        both = zip(ts, times["reference"], live, strict=True)
        ratios = [t / ref - 1 for t, ref, on in both if {arm, "reference"} <= on]
        out[arm] = (median_interval(ratios) if len(ratios) >= 2 else None, len(ratios))
    return out


def run_training_demo(
    out: str = "runs/demo", *, family: str = "gpt2", size: str = "small", steps: int = 60,
    checkpoint_every: int = 10, console: Console | None = None,
) -> dict[str, dict[str, object]]:  # fmt: skip
    """Train the same model on Shakespeare four ways under the same faults; print and report.

    The arms take turns in this process (:func:`~attnchecker.adaptive.bench.alternate`, as
    ``attnchecker bench`` times its arms): an untimed step then ``PER_ROUND`` timed ones each,
    round after round, so that a burst of load lands on every arm alike instead of on whichever
    arm ran during it; an arm's overhead is the median over rounds of its time against the
    reference's in the same round, with its interval."""
    import json
    from pathlib import Path

    from attnchecker import ABFTConfig
    from attnchecker.adaptive.bench import PER_ROUND, alternate
    from attnchecker.report.training import ARMS, COLUMNS, arm_row, demo_report, overhead_note
    from attnchecker.train.loop import TrainConfig, train_steps

    console = console or Console(width=max(Console().width, 140))
    plan = demo_plan(steps)
    base = {"family": family, "size": size, "steps": steps, "checkpoint_every": checkpoint_every}
    arms = {
        "reference": (TrainConfig(**base), None),
        "unprotected": (TrainConfig(**base), plan),
        "checkpoint_restore": (TrainConfig(**base, recovery="checkpoint"), plan),
        # skip_step: the guarded optimizer would skip a step whose fault were beyond repair
        "protected": (TrainConfig(**base, protect=True, abft=ABFTConfig(policy="skip_step")), plan),
    }
    console.print(
        f"\n[bold]Training demo[/]: {family} ({size}) on Shakespeare, {steps} steps, the same "
        f"faults in three arms: INF in a score (step {plan.faults[0].step}), NaN down a context "
        f"column (step {plan.faults[1].step}), near-INF across a Q row "
        f"(step {plan.faults[2].step})."
    )
    runs = {
        arm: _Turns(train_steps(cfg, Path(out) / arm, faults=faults, progress=False))
        for arm, (cfg, faults) in arms.items()
    }
    rounds = steps // (1 + PER_ROUND)
    console.print(f"  {', '.join(runs)}: {1 + PER_ROUND} steps each in turn, {rounds} rounds ...")
    live: list[set[str]] = []  # after each round, the arms still training
    times = alternate(runs, rounds, warm=1, advance=lambda: live.append(_training(runs)))
    for r in runs.values():  # the steps left, untimed: replays after rollbacks, a partial round
        while not r.done:
            r()
    summary: dict[str, dict[str, object]] = {arm: r.summary for arm, r in runs.items()}
    step_s = {arm: _median_step(Path(out) / arm) for arm in ARMS}
    overheads = _overheads(times, live)
    for arm in ARMS:
        s = summary[arm]
        s["median_step_s"] = step_s[arm]
        est, n = overheads[arm]
        if arm == "reference" or s["non_trainable"]:
            est = None  # none for an arm that stopped: its rounds are not the same work
        s["overhead"] = None if est is None else est.point
        s["overhead_interval"] = None if est is None else [est.low, est.high]
        s["overhead_rounds"] = n
        s["recovery_cost_steps"] = (s["save_s"] + s["load_s"]) / step_s["reference"] + s[
            "replayed_steps"
        ]
    summary_doc = {
        "description": f"{family} ({size}), {steps} steps, the same seeded faults in three arms",
        "faults": json.loads(plan.to_json())["faults"],
        "timing": {
            "arms_in_turn": list(runs),
            "untimed_per_turn": 1,
            "timed_per_turn": PER_ROUND,
            "rounds": rounds,
        },
        **summary,
    }
    Path(out, "summary.json").write_text(json.dumps(summary_doc, indent=2))
    report = demo_report(out)
    table = Table()
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "arm" else "right", no_wrap=True)
    for arm in ARMS:
        table.add_row(*arm_row(arm, summary))
    console.print(table)
    console.print(
        f"{overhead_note(summary_doc)} Recovery cost = checkpoint save + load time in training "
        f"steps, plus the steps replayed after each rollback. Report: {report}"
    )
    return summary


def run_demo(
    out: str = "runs/demo", *, family: str = "gpt2", seed: int = 0, backend: str = "eager",
    steps: int = 60,
) -> list[object]:  # fmt: skip
    """``attnchecker demo``: the four parts in turn (the math core, a protected model, the
    diagnosis, and the training demo unless ``steps`` is 0), each printed as it runs. Returns
    the records that fall short of what the demo claims (empty: every claim held): a math
    scenario missed, a protected step whose gradients are off the fault-free ones, a diagnosis
    that blames the wrong cause, a training demo where unprotected training survives its faults
    or protected training does not."""
    records = run_math_demo(seed=seed)
    failed: list[object] = [r for r in records[:-1] if r["status"] == "missed"]
    model = run_model_demo(family=family, seed=seed, backend=backend)
    failed += [r for r in model if r["protected_grad_diff"] > 1e-5]
    found = run_diagnosis_demo(f"{out}/diagnosis", family=family)
    if not _diagnosed_right(found):
        failed.append(found)
    if steps > 0:
        summary = run_training_demo(out, family=family, steps=steps)
        if not _protection_kept_training(summary):
            failed.append(summary)
    return failed


def _protection_kept_training(summary: dict[str, dict[str, object]]) -> bool:
    """The training demo's faults made the unprotected arm non-trainable, not the protected."""
    unprotected, protected = summary["unprotected"], summary["protected"]
    return bool(unprotected["non_trainable"]) and not protected["non_trainable"]


def _diagnosed_right(found: dict[str, list[dict[str, object]]]) -> bool:
    """The failing device's three faults each blamed on the device, and the unstable run
    diagnosed at least once, always as numerics."""
    device, numerics = found["failing device"], found["unstable numerics"]
    return (
        [f["cause"] for f in device] == ["fault"] * 3
        and bool(numerics)
        and all(f["cause"] == "numerics" for f in numerics)
    )


def diagnosis_plan():
    """Faults of a failing device, forward and backward: NaN across a score row, 1e10 in the
    Q projection's weight gradient, INF down a column of dV."""
    from attnchecker.inject import FaultPlan

    return (
        FaultPlan.builder(seed=2)
        .at(2).site("scores", layer=0).kind("nan").pattern("1R").add()
        .at(4).site("dw.q", layer=1).kind("near_inf").add()
        .at(6).site("dv", layer=0).kind("inf").pattern("1C").add()
        .build()
    )  # fmt: skip


def run_diagnosis_demo(
    out: str = "runs/diagnosis", *, family: str = "gpt2", steps: int = 8,
    console: Console | None = None,
) -> dict[str, list[dict[str, object]]]:  # fmt: skip
    """Two protected trainings side by side, every step diagnosed: a failing device (faults in
    forward and backward GEMMs: "your hardware") and a numerically unstable run (fp16 with a
    learning rate 10,000x too high, no fault: "not your hardware"). Returns each arm's
    diagnosis lines (``events.jsonl``) and prints them."""
    import json
    from pathlib import Path

    from attnchecker import ABFTConfig
    from attnchecker.train.loop import TrainConfig, train

    console = console or Console(width=max(Console().width, 132))
    guarded = ABFTConfig(policy="skip_step")
    base = {"family": family, "size": "tiny", "steps": steps, "protect": True, "abft": guarded,
            "stop_when_non_trainable": False}  # fmt: skip
    arms = {
        "failing device": (TrainConfig(**base), diagnosis_plan()),
        "unstable numerics": (TrainConfig(**base, lr=3.0, fp16=True), None),
    }
    console.print(
        f"\n[bold]Diagnosis demo[/]: {family} (tiny), {steps} steps, protected and guarded. Left: "
        "a device that corrupts GEMMs (NaN in the scores at step 2, 1e10 in dW of the Q "
        "projection at step 4, INF down dV at step 6). Right: no fault, fp16 and lr 3.0."
    )
    found: dict[str, list[dict[str, object]]] = {}
    losses: dict[str, dict[int, float]] = {}
    for arm, (cfg, plan) in arms.items():
        train(cfg, Path(out) / arm.replace(" ", "_"), faults=plan, progress=False)
        lines = (Path(out) / arm.replace(" ", "_") / "events.jsonl").read_text().splitlines()
        found[arm] = [r for r in map(json.loads, lines) if r["type"] == "diagnosis"]
        metrics = (Path(out) / arm.replace(" ", "_") / "metrics.jsonl").read_text().splitlines()
        losses[arm] = {r["step"]: r["loss"] for r in map(json.loads, metrics)}
    table = Table(title="each step, diagnosed")
    table.add_column("step", justify="right")
    for arm in arms:
        table.add_column(f"{arm}: loss", justify="right")
        table.add_column(f"{arm}: diagnosis", max_width=48)
    for step in range(1, steps + 1):
        row = [str(step)]
        for arm in arms:
            f = next((r for r in found[arm] if r["step"] == step), None)
            loss = losses[arm].get(step)
            row.append("skipped" if loss is None else f"{loss:.3f}")
            row.append("healthy" if f is None else f"[bold]{f['verdict']}[/]: {f['cause']}")
        table.add_row(*row)
    console.print(table)
    for arm in arms:
        if found[arm]:
            console.print(f"[bold]{arm}[/], first diagnosis: {found[arm][0]['message']}")
    return found
