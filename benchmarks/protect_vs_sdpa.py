"""protect_ against what users run: the plain model with its default SDPA attention (and eager),
eager and under torch.compile, fp32 and bf16 autocast, short and long sequences; plus op counts.

For each family, length, dtype and execution mode, five copies of one model are stepped
alternately in one process (forward, backward, AdamW): ``sdpa`` (transformers' default; GPT-Neo
has no SDPA path, so eager is its default), ``eager``, and three protected arms: ``forward``
(the forward's checks only), ``protected`` (the default: forward and backward) and
``all_linear`` (every linear layer too). Overheads are medians of per-pair time ratios. In
eager mode the attention forward of layer 0 (projections, core, output projection) is timed the
same way on captured inputs, and the aten ops of one training step are counted per attention
module (a layer; BART's decoder layers have two; all ops and launching ops,
:mod:`attnchecker.testing`); on CPU, the time of a protected arm's training step spent inside
the checks' profiler ranges (``attnchecker.*``: the forward's checks, the heads' repair and
``all_linear``'s linear-layer checks; the backward's checks run inside autograd without a
range) is read from ``torch.profiler`` over two steps (mean). Base width (hidden 768, 12 heads;
``--size``), batch 8 at L = 128 and 8 * 128 / L sequences (at least 1) beyond, causal LM for
decoders and masked LM for BERT.

    python benchmarks/protect_vs_sdpa.py [--device cuda] [--families gpt2 bert llama]
        [--lengths 128 1024] [--dtypes fp32 bf16] [--compile eager compiled] [--reps 6] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

from _common import command, environment, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.attention.config import OPS
from attnchecker.models.families import TABLE
from attnchecker.models.registry import discover
from attnchecker.models.tiny import build, no_dropout
from attnchecker.testing import count_ops, inductor_kernels, region_kernels

ATTENTION = ("self_attn", "attn", "attention")  # how transformers' layers name their attention
ALL_ARMS = {  # the protected arms: the forward's checks, + the backward's (default), + every
    # linear; and the default config on the fused Triton kernels (CUDA, or the interpreter)
    "forward": ABFTConfig(ops=OPS),
    "protected": ABFTConfig(),
    "all_linear": ABFTConfig(scope="all_linear"),
    "triton": ABFTConfig(backend="triton"),
    "sdpa_route": ABFTConfig(backend="sdpa"),  # the default config on the SDPA route
}
ARMS = {k: ALL_ARMS[k] for k in ("forward", "protected", "all_linear")}  # --arms


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _autocast(device: str, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _models(family: str, L: int, device: str):
    extra = no_dropout(family, ARGS.size) if ARGS.no_dropout else {}
    base = build(family, ARGS.size, layers=ARGS.layers, max_len=max(L, 128), **extra)
    base.config.use_cache = False
    base.train()
    sdpa = copy.deepcopy(base)
    if TABLE[family].sdpa:
        sdpa.set_attn_implementation("sdpa")
    arms = {"sdpa": sdpa, "eager": base}
    for arm, config in ARMS.items():
        arms[arm] = copy.deepcopy(base)
        protect_(arms[arm], config)
    return {k: m.to(device) for k, m in arms.items()}


def _inputs(L: int, device: str) -> dict[str, torch.Tensor]:
    B = max(1, 8 * 128 // L)
    ids = torch.randint(3, 128, (B, L), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _stepper(model, run, inputs, device, dtype):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        with _autocast(device, dtype):
            loss = run(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _alternate(fns: dict, reps: int, device: str, warmup: int = 2) -> dict[str, list[float]]:
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            f()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    return times


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)) - 1


def _attention_forward(models, inputs, family, device, dtype, reps):
    """Median ms of layer 0's attention module on inputs captured from a forward."""
    calls = {}
    for name, m in models.items():
        layer0, attr = next(
            (x, a) for n, x in m.named_modules() for a in ATTENTION
            if n.endswith(".0") and isinstance(getattr(x, a, None), torch.nn.Module)
        )  # fmt: skip
        attn = getattr(layer0, attr)
        seen = {}
        h = attn.register_forward_pre_hook(
            lambda mod, a, k, seen=seen: seen.setdefault("call", (a, k)), with_kwargs=True
        )
        with torch.no_grad(), _autocast(device, dtype):
            m(**inputs)
        h.remove()
        a, k = seen["call"]

        def call(attn=attn, a=a, k=k) -> None:
            with _autocast(device, dtype):
                attn(*a, **k)

        calls[name] = call
    return _alternate(calls, reps * 3, device)


def _check_ranges(step, calls: int = 2) -> dict[str, float]:
    """Mean ms per training step inside the checks' profiler ranges and of the whole profiled
    step (CPU; both with the profiler's per-op overhead, so their ratio is the share)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        wall = time.perf_counter() - t0
    ranges = (e for e in prof.key_averages() if e.key.startswith("attnchecker."))
    ms = sum(e.cpu_time_total for e in ranges) / 1e3 / calls
    return {"checks_ms": ms, "step_ms": 1e3 * wall / calls, "share": ms / (1e3 * wall / calls)}


def measure(family: str, L: int, dtype: str, mode: str, device: str, reps: int) -> dict:
    models = _models(family, L, device)
    inputs = _inputs(L, device)
    t0 = time.perf_counter()
    runs = {k: (torch.compile(m) if mode == "compiled" else m) for k, m in models.items()}
    steps = {k: _stepper(models[k], runs[k], inputs, device, dtype) for k in models}
    kernels = {}
    for k, f in steps.items():  # compile (or warm up) each arm once, outside the timing
        with inductor_kernels() as calls:  # compiled: the kernels of one step (its first)
            f()
        kernels[k] = calls.total
    setup_s = time.perf_counter() - t0
    times = _alternate(steps, reps, device)
    row = {
        "family": family, "L": L, "batch": inputs["input_ids"].shape[0], "dtype": dtype,
        "mode": mode, "setup_s": setup_s,
        **{f"step_{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
        **{f"{k}_vs_sdpa": _ratio(times, k, "sdpa") for k in ARMS},
        "step_vs_sdpa": _ratio(times, "protected", "sdpa"),
        "step_vs_eager": _ratio(times, "protected", "eager"),
        "eager_vs_sdpa": _ratio(times, "eager", "sdpa"),
    }  # fmt: skip
    if mode == "compiled":
        row["kernels_per_step"] = kernels
    if mode == "eager":
        fwd = _attention_forward(models, inputs, family, device, dtype, reps)
        row.update(
            {f"attn_{k}_ms": 1e3 * statistics.median(v) for k, v in fwd.items()},
            attn_vs_sdpa=_ratio(fwd, "protected", "sdpa"),
            attn_vs_eager=_ratio(fwd, "protected", "eager"),
        )
        if device == "cpu":
            row["check_ranges"] = {k: _check_ranges(steps[k]) for k in ARMS}
        if min(ARGS.lengths) == L:
            ops = {k: count_ops(s) for k, s in steps.items()}
            n = len(discover(models["eager"]).blocks)  # attention modules (BART: 3 per layer)
            row["ops_per_layer"] = {
                "protected_vs_sdpa": (ops["protected"].total - ops["sdpa"].total) / n,
                "protected_vs_sdpa_launching": (ops["protected"].launching - ops["sdpa"].launching) / n,
                "eager_vs_sdpa": (ops["eager"].total - ops["sdpa"].total) / n,
                "sdpa_total_per_layer": ops["sdpa"].total / n,
            }  # fmt: skip
            row["launching_vs_sdpa_per_step"] = {
                k: ops[k].launching - ops["sdpa"].launching for k in ARMS
            }
            # as the step runs: the ops outside compiled check regions plus those regions'
            # kernels (equal to the above where every region resolves to eager ops)
            row["as_run_vs_sdpa_per_step"] = {}
            for k in ARMS:
                with region_kernels() as kernels:
                    steps[k]()
                row["as_run_vs_sdpa_per_step"][k] = (
                    ops[k].launching_outside_regions + kernels.total - ops["sdpa"].launching
                )
    del models, runs, steps
    if mode == "compiled":
        torch._dynamo.reset()
    return row


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _markdown(rows: list[dict], env: dict, cmd: str) -> str:
    lines = [
        "# protect_ vs the plain model as users run it (SDPA), eager and compiled",
        "",
        "Protected arms: `forward` (the forward's seven checks, `ops=OPS`), `protected` (the "
        'default: forward and backward), `all_linear` (`scope="all_linear"`: every linear '
        "layer, forward and backward). Launching ops are per training step beyond SDPA (eager), "
        "all the checks' aten ops, and as run: with the check regions that `check_impl` "
        "compiles (bf16 on a CPU) counted as their kernels (`attnchecker.testing.region_kernels`); "
        "kernels per step are what inductor's output code calls in one compiled training step "
        "(its fused kernels, GEMMs and aten fallbacks; `attnchecker.testing.inductor_kernels`) "
        f"for sdpa / {' / '.join(ARMS)}. `triton`: the default config with "
        '`backend="triton"` (the fused kernels).',
        "",
        f"| family | L | dtype | mode | sdpa ms | {' | '.join(ARMS)} | "
        f"launching ops {' / '.join(ARMS)} | as run | kernels per step (compiled) |",
        "|---|---|---|---|---|" + "---|" * len(ARMS) + "---|---|---|",
        *(
            f"| {r['family']} | {r['L']} | {r['dtype']} | {r['mode']} | {r['step_sdpa_ms']:.1f} | "
            + " | ".join(_pct(r.get(f"{k}_vs_sdpa")) for k in ARMS)
            + " | "
            + " / ".join(str(v) for v in r.get("launching_vs_sdpa_per_step", {}).values())
            + " | "
            + " / ".join(str(v) for v in r.get("as_run_vs_sdpa_per_step", {}).values())
            + " | "
            + " / ".join(str(r.get("kernels_per_step", {}).get(k, "")) for k in ("sdpa", *ARMS))
            * ("kernels_per_step" in r)
            + " |"
            for r in rows
        ),
        "",
        "## the default arm in detail",
        "",
        f"`{cmd}`; torch {env['torch']}, {env['threads']} threads, {env['processor']}, "
        f"{env['date']}. {WIDTH[ARGS.size]}, {ARGS.layers} layers, batch 8 at "
        "L = 128 (8 * 128 / L sequences beyond), train mode, AdamW. "
        f"{2 + len(ARMS)} copies (sdpa, eager and the protected arms) stepped "
        "alternately in one process; overhead = median of per-pair time ratios - 1; nothing "
        "subtracted. Ops: aten ops of one eager training step per attention module beyond the "
        "SDPA model (all / launching, i.e. without views). Check ranges: ms of one protected "
        "training step inside the checks' profiler ranges (`attnchecker.*`: the forward's checks "
        "and repair; the backward's checks have no range) / ms of that profiled step, means of "
        "two profiled steps (both carry the profiler's per-op overhead).",
        "",
        "| family | L | dtype | mode | sdpa ms | eager ms | protected ms | vs sdpa | vs eager | "
        "eager vs sdpa | attn fwd vs sdpa | attn fwd vs eager | extra ops/layer (all / launching) "
        "| check ranges / step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ops = r.get("ops_per_layer")
        ops_s = (
            f"{ops['protected_vs_sdpa']:.0f} / {ops['protected_vs_sdpa_launching']:.0f}"
            if ops
            else ""
        )
        cr = r.get("check_ranges", {}).get("protected")
        ranges = f"{cr['checks_ms']:.1f} / {cr['step_ms']:.0f}" if cr else ""
        lines.append(
            f"| {r['family']} | {r['L']} | {r['dtype']} | {r['mode']} | {r['step_sdpa_ms']:.1f} | "
            f"{r['step_eager_ms']:.1f} | {r['step_protected_ms']:.1f} | {_pct(r['step_vs_sdpa'])} | "
            f"{_pct(r['step_vs_eager'])} | {_pct(r['eager_vs_sdpa'])} | {_pct(r.get('attn_vs_sdpa'))} | "
            f"{_pct(r.get('attn_vs_eager'))} | {ops_s} | {ranges} |"
        )
    return "\n".join(lines) + "\n"


WIDTH = {"tiny": "Tiny width (hidden 32, 4 heads)", "small": "Small width (hidden 256, 4 heads)",
         "base": "Base width (hidden 768, 12 heads)"}  # fmt: skip
ARGS = argparse.Namespace(layers=2, lengths=[128], size="base")


def main() -> None:
    global ARGS, ARMS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--families", nargs="+", default=["gpt2", "bert", "llama"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 1024])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument(
        "--compile", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"]
    )
    ap.add_argument(
        "--compile-max-len",
        type=int,
        default=None,
        help="compiled arms only up to this L (default: 128 on CPU, all on CUDA)",
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", default="base", choices=["tiny", "small", "base"],
                    help="model width (attnchecker.models.tiny: hidden 32 / 256 / 768)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tag", default="", help="suffix of the result files (a focused rerun)")
    ap.add_argument("--no-dropout", action="store_true",
                    help="every dropout probability 0 (so that the SDPA route runs its kernel)")  # fmt: skip
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ALL_ARMS),
                    help="protected arms beside sdpa and eager (protected is always measured)")  # fmt: skip
    ARGS = parse(
        ap,
        quick={"families": ["gpt2"], "lengths": [128], "dtypes": ["fp32", "bf16"],
               "compile": ["eager"], "layers": 1, "size": "tiny", "reps": 1},
    )  # fmt: skip
    ARMS = {k: ALL_ARMS[k] for k in ALL_ARMS if k in ARGS.arms or k == "protected"}
    limit = ARGS.compile_max_len or (128 if ARGS.device == "cpu" else max(ARGS.lengths))
    env = environment()
    rows = []
    configs = [  # eager first: a run cut short keeps the cheap, most telling rows
        (family, L, dtype, mode)
        for mode in ARGS.compile
        for family in ARGS.families
        for L in ARGS.lengths
        for dtype in ARGS.dtypes
        if not (mode == "compiled" and limit < L)
    ]
    for family, L, dtype, mode in configs:
        r = measure(family, L, dtype, mode, ARGS.device, ARGS.reps)
        rows.append(r)
        _write(rows, env)  # after every row: a run cut short keeps what it measured
        print(
            f"{family:6s} L={L:5d} {dtype} {mode:8s} sdpa {r['step_sdpa_ms']:8.1f} ms  "
            f"protected {_pct(r['step_vs_sdpa'])} vs sdpa, {_pct(r['step_vs_eager'])} vs eager"
            + (f"  attn fwd {_pct(r['attn_vs_sdpa'])} vs sdpa" if "attn_vs_sdpa" in r else ""),
            flush=True,
        )  # fmt: skip


def _write(rows: list[dict], env: dict) -> None:
    cmd = command()
    write("protect_vs_sdpa" + (f"_{ARGS.tag}" if ARGS.tag else ""), {"environment": env, "args": vars(ARGS), "rows": rows},
          _markdown(rows, env, cmd))  # fmt: skip


if __name__ == "__main__":
    main()
