"""False alarms of protect_ over clean training under real dynamics: per family, dtype and scope,
and in a regime of outlier features.

Every run trains a tiny protected model on Shakespeare (BPE 512, L 64, batch 4) with AdamW, the
recipe of :func:`attnchecker.testing.clean_run` with the ``ABFTConfig`` passed in and detections
counted per op. Nothing is injected, so every detection is a false alarm. Two regimes:

1. ``default``: every family of the table, in fp32 and under bf16 and fp16 autocast (CPU
   autocast, no loss scaling: the checks see what a low-precision step computes), under
   ``ABFTConfig()`` (the default: the forward's and the backward's checks of attention) and
   ``ABFTConfig(scope="all_linear")`` (every linear layer too); AdamW at lr 5e-3 (high for these
   models: every norm weight moves, LayerNorm, RMSNorm and Qwen3's / OLMo 2's q_norm /
   k_norm), two embedding features 30x larger than the rest (the massive activations of
   trained LLMs). 15 families x 3 dtypes x 2 configs x 50 steps = 4,500 steps.
2. ``outliers``: two embedding features scaled x10 / x60 / x200, AdamW at lr 1e-3 / 3e-3 /
   1e-2, init seeds 0, 1, 2 (the seed also picks the batches), ``ABFTConfig()``, per family of
   ``--outlier-families`` and dtype of ``--outlier-dtypes``. This regime gave false alarms in
   the dQ check of the backward; the table reports every configuration, alarms and their ops.

``ABFTConfig()``'s policy is ``raise``: an uncorrectable detection raises at ``drain()``, after
the step's update; the run counts the step as raised and trains on (a user's run would stop).

    python benchmarks/clean_false_alarms.py [--steps 50] [--outlier-steps 60] [--quick]
        [--families ...] [--outlier-families gpt2 llama bert] [--outlier-seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from _common import command, environment, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.errors import UncorrectableFaultError
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import build, no_dropout
from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = {
    "ABFTConfig()": ABFTConfig(),
    'ABFTConfig(scope="all_linear")': ABFTConfig(scope="all_linear"),
}
SEQ_LEN, BATCH = 64, 4


@dataclass(frozen=True)
class Run:
    """One clean protected training run: every detection is a false alarm."""

    regime: str
    family: str
    dtype: str
    config: str  # the key of CONFIGS
    outliers: float
    lr: float
    seed: int
    steps: int
    alarm_steps: int  # steps whose drain() returned an event or raised
    raised: int  # steps whose drain() raised (policy "raise": an uncorrectable detection)
    detected: int  # flagged rows (or fused-kernel tiles) over the run, all ops
    uncorrectable: int
    by_op: dict[str, int] = field(default_factory=dict)  # op -> flagged rows (ops that flagged)
    loss_first: float = 0.0
    loss_last: float = 0.0
    norm_drift: float = 0.0  # largest |w - w_0| over the weights of every norm layer


def _is_norm(name: str) -> bool:
    owner = name.rsplit(".", 2)[-2]
    return "norm" in owner.lower() or owner.startswith("ln")


def clean(blocks, regime, family, dtype, config, *, steps, lr, outliers, seed, backend="eager",
          dropout=True) -> Run:  # fmt: skip
    extra = {} if dropout else no_dropout(family)
    model = build(family, vocab_size=blocks.vocab_size, max_len=SEQ_LEN, seed=seed, **extra)
    model.train()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, :2] *= outliers
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if _is_norm(n)}
    handle = protect_(model, CONFIGS[config].replace(backend=backend))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    low = DTYPES[dtype]
    alarm_steps = raised = 0
    losses = []
    for step in range(steps):
        ids, _ = blocks.batch(step, BATCH, seed)
        with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        try:
            alarm_steps += bool(handle.drain())
        except UncorrectableFaultError:
            alarm_steps += 1
            raised += 1
        losses.append(float(loss.detach()))
    counters = handle.counters()
    by_op = {op: c["detected"] for op, c in counters.items() if c["detected"]}
    params = dict(model.named_parameters())
    moves = (float((params[n].detach() - w).abs().max()) for n, w in norms.items())
    drift = max(moves, default=0.0)
    return Run(
        regime, family, dtype, config, outliers, lr, seed, steps, alarm_steps, raised,
        sum(by_op.values()), sum(c["uncorrectable"] for c in counters.values()), by_op,
        losses[0], losses[-1], drift,
    )  # fmt: skip


def _ops(r: Run) -> str:
    return ", ".join(f"{op} {n}" for op, n in r.by_op.items()) or "-"


def _markdown(runs: list[Run], args, seconds: float) -> str:
    default = [r for r in runs if r.regime == "default"]
    outl = [r for r in runs if r.regime == "outliers"]
    steps = lambda rs: sum(r.steps for r in rs)
    alarms = lambda rs: sum(r.alarm_steps for r in rs)
    lines = [
        "# Clean-run false alarms of protect_ (tiny models, Shakespeare, AdamW)",
        "",
        f"`{command()}`; backend {args.backend}"
        f"{', dropout off' if args.no_dropout else ''}; {seconds:.0f} s. Nothing injected: every "
        "detection is a false alarm. Alarm steps: steps whose `drain()` returned events or raised "
        "(`ABFTConfig()`'s policy is `raise`: the run counts the step and trains on); detections: "
        "flagged rows per op over the run. L 64, batch 4, BPE 512.",
        "",
        "## Default regime: every family, fp32 / bf16 / fp16, two configs",
        "",
        "AdamW lr 5e-3, two embedding features x30.",
        "",
        "| config | dtype | runs | steps | alarm steps | detections |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        for dtype in DTYPES:
            rs = [r for r in default if (r.config, r.dtype) == (config, dtype)]
            if rs:
                lines.append(
                    f"| `{config}` | {dtype} | {len(rs)} | {steps(rs)} | {alarms(rs)} | "
                    f"{sum(r.detected for r in rs)} |"
                )
    for config in CONFIGS:
        rs = [r for r in default if r.config == config]
        lines.append(f"\n`{config}`: **{alarms(rs)} alarm steps in {steps(rs)} clean steps**.")
    lines += [
        "",
        "| config | family | dtype | steps | alarm steps | raised | detections by op | "
        "loss first -> last | max norm-weight move |",
        "|---|---|---|---:|---:|---:|---|---|---:|",
    ]
    lines += [
        f"| `{r.config}` | {r.family} | {r.dtype} | {r.steps} | {r.alarm_steps} | {r.raised} | "
        f"{_ops(r)} | {r.loss_first:.2f} -> {r.loss_last:.2f} | {r.norm_drift:.3f} |"
        for r in default
    ]
    if outl:
        lines += [
            "",
            "## Outlier features: two embedding features x10 / x60 / x200, AdamW lr 1e-3 .. 1e-2",
            "",
            f"`ABFTConfig()`; init seeds 0 .. {args.outlier_seeds - 1}; "
            f"{steps(outl)} steps, **{alarms(outl)} alarm steps**. Runs with alarms / runs, per "
            "outlier scale and learning rate (over families, dtypes and seeds):",
            "",
            "| outlier scale | " + " | ".join(f"lr {lr:g}" for lr in args.outlier_lrs) + " |",
            "|---|" + "---|" * len(args.outlier_lrs),
        ]
        for x in args.outlier_scales:
            cells = []
            for lr in args.outlier_lrs:
                rs = [r for r in outl if (r.outliers, r.lr) == (x, lr)]
                cells.append(f"{sum(r.alarm_steps > 0 for r in rs)} / {len(rs)}")
            lines.append(f"| x{x:g} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "| family | dtype | outliers | lr | seed | steps | alarm steps | raised | "
            "detections by op | loss first -> last |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        lines += [
            f"| {r.family} | {r.dtype} | x{r.outliers:g} | {r.lr:g} | {r.seed} | {r.steps} | "
            f"{r.alarm_steps} | {r.raised} | {_ops(r)} | {r.loss_first:.2f} -> {r.loss_last:.2f} |"
            for r in outl
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="steps per run, default regime")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--lr", type=float, default=5e-3, help="default regime")
    ap.add_argument("--outlier-steps", type=int, default=60, help="steps per run, outliers")
    ap.add_argument("--outlier-families", nargs="+", default=["gpt2", "llama", "bert"],
                    choices=FAMILIES)  # fmt: skip
    ap.add_argument("--outlier-dtypes", nargs="+", default=["fp32"], choices=DTYPES)
    ap.add_argument("--outlier-scales", nargs="+", type=float, default=[10.0, 60.0, 200.0])
    ap.add_argument("--outlier-lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--outlier-seeds", type=int, default=3, help="init seeds 0 .. n-1")
    ap.add_argument("--tag", default="", help="suffix of the result files (a focused rerun)")
    ap.add_argument("--backend", default="eager", choices=["eager", "sdpa", "triton"],
                    help="ABFTConfig.backend of every run")  # fmt: skip
    ap.add_argument("--no-dropout", action="store_true",
                    help="every dropout probability 0 (so that the sdpa route runs)")  # fmt: skip
    args = parse(
        ap,
        quick={
            "steps": 3, "families": ["gpt2", "llama"], "outlier_steps": 3,
            "outlier_families": ["llama"], "outlier_scales": [10.0, 200.0],
            "outlier_lrs": [1e-2], "outlier_seeds": 1,
        },
    )  # fmt: skip
    corpus = load_corpus()
    blocks = TokenBlocks.build(corpus, tokenizer_for(corpus, 512), SEQ_LEN)
    plan = [
        ("default", fam, dtype, config, args.lr, 30.0, 0, args.steps)
        for config in CONFIGS
        for fam in args.families
        for dtype in args.dtypes
    ] + [
        ("outliers", fam, dtype, "ABFTConfig()", lr, x, seed, args.outlier_steps)
        for fam in args.outlier_families
        for dtype in args.outlier_dtypes
        for x in args.outlier_scales
        for lr in args.outlier_lrs
        for seed in range(args.outlier_seeds)
    ]
    runs, t0 = [], time.perf_counter()
    for i, (regime, fam, dtype, config, lr, x, seed, steps) in enumerate(plan):
        r = clean(blocks, regime, fam, dtype, config, steps=steps, lr=lr, outliers=x, seed=seed,
                  backend=args.backend, dropout=not args.no_dropout)  # fmt: skip
        runs.append(r)
        print(f"[{i + 1}/{len(plan)} {time.perf_counter() - t0:.0f} s] {regime} {config} {fam} "
              f"{dtype} x{x:g} lr {lr:g} seed {seed}: {r.alarm_steps} alarm steps / {r.steps} "
              f"({_ops(r)}), loss {r.loss_first:.2f} -> {r.loss_last:.2f}", flush=True)  # fmt: skip
    seconds = time.perf_counter() - t0
    payload = {
        "env": environment(),
        "args": vars(args),
        "seconds": seconds,
        "configs": {k: c.replace(backend=args.backend).to_dict() for k, c in CONFIGS.items()},
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    theme = "clean_false_alarms" + (f"_{args.tag}" if args.tag else "")
    write(theme, payload, _markdown(runs, args, seconds))


if __name__ == "__main__":
    main()
