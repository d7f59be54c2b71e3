"""False alarms of the checks beyond the GEMMs (``ABFTConfig(invariants=("norm", "update"))``)
over clean training under real dynamics.

Every run trains a tiny model of one family on Shakespeare (BPE 512, L 64, batch 4) with AdamW
guarded by :func:`attnchecker.guard` (the update check), its norm modules checked, and no GEMM
check (``ops=()``: their false alarms are ``clean_false_alarms.py``'s). Two embedding features
are 30x larger than the rest (the massive activations of trained LLMs). Nothing is injected:
every event is a false alarm. Arms: fp32; bf16 and fp16 autocast (fp32 weights and optimizer
state); bf16 weights (``model.to(torch.bfloat16)``: the optimizer's state and update in bf16);
AdamW lr 1e-3 and 1e-2 (every norm weight moves).

    python benchmarks/invariants_clean.py [--steps 25] [--families ...] [--quick]
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass

import torch

from _common import command, environment, parse, write
from attnchecker import ABFTConfig, guard, protect_
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import build
from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

ARMS = ("fp32", "bf16", "fp16", "bf16-weights", "kernels-fp32", "kernels-bf16")
KERNEL_ARMS = ("kernels-fp32", "kernels-bf16")  # check_impl="triton": the kernels (the
# interpreter on a CPU: run with TRITON_INTERPRET=1), the checked AdamW among them
SEQ_LEN, BATCH = 64, 4


@dataclass(frozen=True)
class Run:
    family: str
    arm: str
    lr: float
    steps: int
    norms: int  # norm modules checked
    events: int  # every one a false alarm
    ops: str
    loss_first: float
    loss_last: float


def clean(blocks, family: str, arm: str, lr: float, steps: int, seed: int = 0) -> Run:
    model = build(family, vocab_size=blocks.vocab_size, max_len=SEQ_LEN, seed=seed)
    model.train()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, :2] *= 30.0
    if arm == "bf16-weights":
        model.to(torch.bfloat16)
    config = ABFTConfig(ops=(), invariants=("norm", "update"), policy="warn",
                        check_impl="triton" if arm in KERNEL_ARMS else "auto")
    handle = protect_(model, config)
    opt = guard(torch.optim.AdamW(model.parameters(), lr=lr), handle, names=model)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16,
           "kernels-bf16": torch.bfloat16}.get(arm)  # fmt: skip
    events, ops, losses = 0, set(), []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*uncorrectable", RuntimeWarning)
        for step in range(steps):
            ids, _ = blocks.batch(step, BATCH, seed)
            with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            found = handle.drain()
            events += sum(e.count for e in found)
            ops |= {e.op for e in found}
            losses.append(float(loss.detach()))
    norms = len(handle.summary()["invariants"]["norm"]["checked"])
    return Run(family, arm, lr, steps, norms, events, ", ".join(sorted(ops)) or "-",
               losses[0], losses[-1])  # fmt: skip


def _markdown(runs: list[Run], seconds: float) -> str:
    lines = [
        "# Clean-run false alarms of the norm and update checks (tiny models, Shakespeare)",
        "",
        f"`{command()}`; {seconds:.0f} s. `ABFTConfig(ops=(), invariants=('norm', 'update'))`, "
        "AdamW guarded by `attnchecker.guard` (the update check), two embedding features x30. "
        "Nothing injected: every event is a false alarm.",
        "",
        "| arm | lr | runs | steps | norm modules checked | events |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in ARMS:
        for lr in sorted({r.lr for r in runs}):
            rs = [r for r in runs if (r.arm, r.lr) == (arm, lr)]
            if rs:
                lines.append(f"| {arm} | {lr:g} | {len(rs)} | {sum(r.steps for r in rs)} | "
                             f"{sum(r.norms for r in rs)} | {sum(r.events for r in rs)} |")  # fmt: skip
    total = sum(r.steps for r in runs)
    lines += [
        "",
        f"**{sum(r.events for r in runs)} events in {total} clean steps.**",
        "",
        "| family | arm | lr | steps | norms | events | ops | loss first -> last |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    lines += [
        f"| {r.family} | {r.arm} | {r.lr:g} | {r.steps} | {r.norms} | {r.events} | {r.ops} | "
        f"{r.loss_first:.2f} -> {r.loss_last:.2f} |"
        for r in runs
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--arms", nargs="+", default=[a for a in ARMS if a not in KERNEL_ARMS],
                    choices=ARMS)  # fmt: skip
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 1e-2])
    args = parse(ap, {"steps": 2, "families": ["llama", "gpt2"], "lrs": [1e-2]})
    torch.manual_seed(0)
    corpus = load_corpus()
    blocks = TokenBlocks.build(corpus, tokenizer_for(corpus, 512), SEQ_LEN)
    t0, runs = time.perf_counter(), []
    for family in args.families:
        for arm in args.arms:
            for lr in args.lrs:
                r = clean(blocks, family, arm, lr, args.steps)
                runs.append(r)
                print(f"{family:10s} {arm:12s} lr {lr:g}: {r.events} events "
                      f"({r.loss_first:.2f} -> {r.loss_last:.2f})", flush=True)  # fmt: skip
    seconds = time.perf_counter() - t0
    theme = "invariants_clean_kernels" if set(args.arms) <= set(KERNEL_ARMS) else "invariants_clean"
    write(theme, {"runs": [r.__dict__ for r in runs], "env": environment()},
          _markdown(runs, seconds))  # fmt: skip


if __name__ == "__main__":
    main()
