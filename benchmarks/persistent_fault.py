"""A persistent small fault: how many steps until it is detected and the device named.

Production's faulty units are persistent but intermittent and their errors mostly small
(``../shared/spec/detection-power.md``). Here one element of one site is multiplied by
(1 + 2^-4) at every step (a random element each step, as a faulty unit hits whatever runs on it),
on a tiny model training on Shakespeare under bf16 autocast with AdamW, protected with
``ABFTConfig(policy="warn")`` (the checks correct what they see and training goes on). Per site
and seed: the first step whose drain reports the site, and the step at which the device is named
a quarantine candidate (``recovery.ledger``: faults at 2 distinct steps); "-" where it never
happens within ``--steps``.

    python benchmarks/persistent_fault.py [--family llama] [--steps 40] [--seeds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

if "--check-impl" in sys.argv and not torch.cuda.is_available():  # the registered ops run in
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's interpreter (set before import)

from _common import command, environment, impl_tag, impl_words, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.models.tiny import build
from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

SEQ_LEN, BATCH = 64, 4
FACTOR = 1 + 2.0**-4
SITES = ("q", "v", "out", "dx.q", "dw.v")  # forward projections and backward GEMMs


def run(blocks, family: str, site: str, seed: int, steps: int, size: str = "tiny",
        check_impl: str = "auto") -> dict:  # fmt: skip
    model = build(family, size, vocab_size=blocks.vocab_size, max_len=SEQ_LEN, seed=seed,
                  num_hidden_layers=1)  # fmt: skip
    model.train()
    handle = protect_(model, ABFTConfig(policy="warn", check_impl=check_impl))
    g = torch.Generator().manual_seed(1000 + seed)

    def stuck(call):  # layer 0, a random element, every call of the step's first pass
        if call.layer == 0 and not call.replay:
            t = call.tensor.reshape(-1)
            i = int(torch.randint(0, t.numel(), (), generator=g))
            t[i] = t[i] * FACTOR

    handle.attach(stuck, sites=[site])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = named = None
    for step in range(1, steps + 1):
        ids, _ = blocks.batch(step, BATCH, seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            events = handle.drain()
        if first is None and any(e.op == site for e in events):
            first = step
        if named is None and any(e.quarantine for e in events):
            named = step
        if named is not None:
            break
    return {"family": family, "size": size, "site": site, "seed": seed,
            "first_detected": first, "named": named}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sites", nargs="+", default=list(SITES))
    ap.add_argument("--sizes", nargs="+", default=["tiny"], help="tiny (head dim 8), small, base")
    ap.add_argument("--check-impl", default="auto", help="ABFTConfig.check_impl (accumulator: "
                    "the projections on the accumulator GEMM)")  # fmt: skip
    args = parse(ap, quick={"steps": 4, "seeds": 1, "sites": ["q"]})
    t0 = time.perf_counter()
    corpus = load_corpus()
    blocks = TokenBlocks.build(corpus, tokenizer_for(corpus, 512), SEQ_LEN)
    rows = []
    for size in args.sizes:
        for site in args.sites:
            for seed in range(args.seeds):
                row = run(blocks, args.family, site, seed, args.steps, size, args.check_impl)
                print(row, flush=True)
                rows.append(row)
    env = environment()
    cell = lambda v: "-" if v is None else str(v)
    lines = [
        "# A persistent small fault: steps to detection and to the device named",
        "",
        f"`{command()}`; {env['date']}, torch {env['torch']}, {time.perf_counter() - t0:.0f} s. "
        f"One element of one site of layer 0 x (1 + 2^-4) at every step (a random element each "
        f"step), {args.family} ({'/'.join(args.sizes)}, 1 layer), bf16 autocast, AdamW lr 1e-3, L {SEQ_LEN}, batch {BATCH}, "
        f"`ABFTConfig(policy='warn', check_impl={args.check_impl!r})` "
        f"({impl_words(args.check_impl)}). '-': not within "
        f"{args.steps} steps.",
        "",
        "| size | site | seed | first detected at step | device named at step |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['size']} | {r['site']} | {r['seed']} | {cell(r['first_detected'])} | "
                     f"{cell(r['named'])} |")  # fmt: skip
    write(f"persistent_fault{impl_tag(args.check_impl)}", {"environment": env, "rows": rows},
          "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
