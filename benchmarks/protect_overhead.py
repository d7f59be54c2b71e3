"""Overhead of protect_ on training steps and on the attention forward, per family, on this machine.

Base width as in the published evaluation: hidden 768, 12 heads, d = 64, batch 8, L = 128,
fp32, sequence classification, train mode (dropout on). For each family a plain and a protected
copy of the same model are stepped alternately in one process (forward, backward, AdamW);
the overhead is the median over repetitions of the per-pair time ratio. The attention forward
is timed on the first attention layer with captured inputs; its breakdown checks one op at a
time (``ABFTConfig(ops=(op,))``) against the instrumented model with no checks (``ops=()``).

    python benchmarks/protect_overhead.py [--families bert gpt2] [--layers 2] [--reps 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from _common import alternate, environment, median_ms, write
from attnchecker import ABFTConfig, protect_
from attnchecker.attention.config import OPS
from attnchecker.models.tiny import FAMILIES, build

B, L = 8, 128


def _inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (B, L), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(B, L, dtype=torch.long),
        "labels": ids[:, 0] % 2,
    }


def _stepper(model, inputs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _attention_module(model, family):
    """The module that runs one whole attention layer (projections, core, output projection)."""
    names = {
        "bert": "attention",
        "roberta": "attention",
        "gpt2": "attn",
        "gpt_neo": "attn",
        "llama": "self_attn",
    }
    layer0 = next(
        m for n, m in model.named_modules() if n.endswith(".0") and hasattr(m, names[family])
    )
    return getattr(layer0, names[family])


def _capture(module, run):
    seen = {}

    def hook(mod, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    h = module.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        run()
    h.remove()
    return seen["call"]


def _breakdown(attn, args, kwargs, calls: int = 5) -> dict[str, float]:
    """Mean ms per attention forward spent inside each check's profiler range."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            attn(*args, **kwargs)
    out = {op: 0.0 for op in OPS}
    for ev in prof.key_averages():
        if ev.key.startswith("attnchecker."):
            for op in ev.key.removeprefix("attnchecker.").split("+"):
                out[op] += ev.cpu_time_total / 1e3 / calls / len(ev.key.split("+"))
    return out


def measure(family: str, layers: int, reps: int, mode: str) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    plain = build(family, "base", task="cls", layers=layers, max_len=L)
    plain.config.use_cache = False  # the captured attention call must not grow a KV cache
    plain.train()
    protected = copy.deepcopy(plain)
    protect_(protected, ABFTConfig(mode=mode))
    inputs = _inputs(g)
    # Training step: plain vs protected, alternated.
    steps = alternate(
        {"plain": _stepper(plain, inputs), "protected": _stepper(protected, inputs)}, reps, warmup=2
    )
    step_ratio = statistics.median(
        p / q for p, q in zip(steps["protected"], steps["plain"], strict=True)
    )
    # Attention forward of layer 0 (projections, core, output projection), alternated.
    args, kwargs = _capture(_attention_module(plain, family), lambda: plain(**inputs))
    attn = {
        "plain": _attention_module(plain, family),
        "protected": _attention_module(protected, family),
    }
    fwd = alternate(
        {k: (lambda a=a: a(*args, **kwargs)) for k, a in attn.items()}, reps * 4, warmup=3
    )
    ratio = statistics.median(p / q for p, q in zip(fwd["protected"], fwd["plain"], strict=True))
    return {
        "family": family,
        "layers": layers,
        "mode": mode,
        "step_plain_ms": median_ms(steps["plain"]),
        "step_protected_ms": median_ms(steps["protected"]),
        "step_overhead": step_ratio - 1,
        "attn_plain_ms": median_ms(fwd["plain"]),
        "attn_protected_ms": median_ms(fwd["protected"]),
        "attn_overhead": ratio - 1,
        "check_ms": _breakdown(attn["protected"], args, kwargs),
    }


def _markdown(rows: list[dict[str, object]], env: dict[str, object], reps: int) -> str:
    lines = [
        "# protect_: training-step and attention-forward overhead",
        "",
        f"`python benchmarks/protect_overhead.py --reps {reps}`; torch {env['torch']}, {env['threads']} "
        f"threads, {env['processor']}, {env['date']}. Base width (hidden 768, 12 heads), batch {B}, "
        f"L = {L}, fp32, train mode, sequence classification. Medians of alternated repetitions; "
        "overhead = median of per-pair (protected / plain) - 1. Nothing subtracted.",
        "",
        "| family | mode | layers | step plain ms | step protected ms | step overhead | attention fwd plain ms | protected ms | attention overhead |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['mode']} | {r['layers']} | {r['step_plain_ms']:.1f} | {r['step_protected_ms']:.1f} | "
            f"{100 * r['step_overhead']:.1f}% | {r['attn_plain_ms']:.2f} | {r['attn_protected_ms']:.2f} | "
            f"{100 * r['attn_overhead']:.1f}% |"
        )
    lines += [
        "",
        "Where the cost sits: ms of one attention layer's forward spent inside each check (profiler ranges, "
        "mean of 5 calls; a fused Q|K|V check is split evenly).",
        "",
        "| family | mode | " + " | ".join(OPS) + " | total |",
        "|---|---|" + "---|" * (len(OPS) + 1),
    ]
    for r in rows:
        checks = " | ".join(f"{r['check_ms'][op]:.2f}" for op in OPS)
        lines.append(
            f"| {r['family']} | {r['mode']} | {checks} | {sum(r['check_ms'].values()):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", nargs="+", default=["passing"], choices=["passing", "naive"])
    args = ap.parse_args()
    env = environment()
    rows = []
    for fam, mode in [(f, m) for f in args.families for m in args.modes]:
        r = measure(fam, args.layers, args.reps, mode)
        rows.append(r)
        print(
            f"{fam:8s} {mode:7s} step {r['step_plain_ms']:7.1f} -> {r['step_protected_ms']:7.1f} ms ({100 * r['step_overhead']:+.1f}%)  "
            f"attention {r['attn_plain_ms']:6.2f} -> {r['attn_protected_ms']:6.2f} ms ({100 * r['attn_overhead']:+.1f}%)  "
            f"checks " + " ".join(f"{op}={v:.2f}" for op, v in r["check_ms"].items())
        )
    write(
        "protect_overhead",
        {"environment": env, "reps": args.reps, "rows": rows},
        _markdown(rows, env, args.reps),
    )


if __name__ == "__main__":
    main()
