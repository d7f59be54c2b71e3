"""Every check kernel of one protected training step, timed alone on the GPU, against what the
cost model (``attnchecker.gpu_cost``) charges it: the rows that fit the model's device constants
(issue 54: ``bandwidth``, ``kernel`` and ``program_rate`` of ``H200`` were never set against a
kernel's time). The second stage of ``scripts/gpu_check.sh``.

A 1-layer llama at Llama-8B widths (L 4096) and at base width (L 1024), B 1, bf16 autocast over
fp32 weights, the default config as CUDA runs it (the SDPA route, the GEMM checks as registered
Triton ops) with the checks beyond the GEMMs (``invariants=("norm", "update")``, fused AdamW
guarded): a few warm-up steps, then ``--reps`` steps in which every Triton launch is bracketed
by CUDA events (``JITFunction.run``: the kernels run as they do, one stream, back to back). Per
launch: its kernel, grid, programs, bytes of arguments (the bytes a repair on a clean step reads
are its flags'), the median measured microseconds, the model's and their ratio; then per width
the fitted rates: the bandwidth of the launches with at least as many programs as SMs, the
per-program rate of those with fewer, the floor (the median of the smallest). Each width's rows
are appended to ``--out`` (JSON lines) the moment they are measured.

``--tiny``: hidden 32 at L 64 on a CPU, in Triton's interpreter, timed by the host clock
(meaningless numbers: ``tests/integration/test_gpu_stage.py`` runs the stage so, that it cannot
fail on a typo when a GPU is lent).

    python benchmarks/kernel_times.py [--widths 8b base] [--reps 5] [--out rows.jsonl] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnchecker import ABFTConfig, guard, protect_  # noqa: E402
from attnchecker.gpu_cost import FLAG_BYTES, H200, LLAMA_8B, SMS, clean_exit  # noqa: E402
from attnchecker.kernels.launches import arg_bytes  # noqa: E402
from attnchecker.models.tiny import build  # noqa: E402

WIDTHS = {"8b": (LLAMA_8B, 4096), "base": ({}, 1024)}
TINY = ({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "head_dim": 8}, 64)  # fmt: skip


@contextlib.contextmanager
def timed(rows: list):
    """Each Triton launch while active: (kernel, grid, bytes, a callable giving its time in
    seconds): CUDA events around ``JITFunction.run`` on a GPU, the host clock in the
    interpreter."""
    if CUDA:
        from triton.runtime.jit import JITFunction

        real = JITFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = real(self, *args, grid=grid, warmup=warmup, **kwargs)
            end.record()
            rows.append((self.fn.__name__, tuple(g) + (1,) * (3 - len(g)), arg_bytes(args),
                         lambda: start.elapsed_time(end) / 1e3))  # fmt: skip
            return out

        with _patch(JITFunction, "run", run):
            yield
        return
    from attnchecker.kernels import launches

    with launches.recorded(run=True) as log:
        t0 = time.perf_counter()
        yield
        took = (time.perf_counter() - t0) / max(len(log), 1)  # (the interpreter: no meaning)
        rows += [(n.kernel, n.grid, n.bytes, lambda t=took: t) for n in log]


@contextlib.contextmanager
def _patch(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def measure(width: str) -> dict:
    widths, L = TINY if ARGS.tiny else WIDTHS[width]
    device = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    model = build("llama", "base", layers=1, max_len=L, vocab_size=32000 if CUDA else 128,
                  **widths).to(device)  # fmt: skip
    model.config.use_cache = False
    model.train()
    model.set_attn_implementation("sdpa")
    # the checks beyond the GEMMs too (issue 57): the norms' kernel and the update's row sums
    handle = protect_(model, ABFTConfig(backend="sdpa", check_impl="triton",
                                        invariants=("norm", "update")))  # fmt: skip
    opt = guard(torch.optim.AdamW(model.parameters(), lr=1e-5, fused=CUDA), handle)
    ids = torch.randint(3, 128, (1, L), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    reps: list[list] = []
    for _ in range(ARGS.reps):
        rows: list = []
        with timed(rows):
            step()
        if CUDA:
            torch.cuda.synchronize()
        reps.append([(k, g, b, t()) for k, g, b, t in rows])
    launches = []
    for i, (kernel, grid, nbytes, _) in enumerate(reps[0]):
        programs = grid[0] * grid[1] * grid[2]
        touched = programs * FLAG_BYTES if clean_exit(kernel) else nbytes
        got = statistics.median(r[i][3] for r in reps if len(r) > i)
        model_s = H200.triton_time(touched, programs)
        launches.append({"kernel": kernel, "grid": list(grid), "programs": programs,
                         "bytes": touched, "measured_us": got * 1e6, "modelled_us": model_s * 1e6,
                         "ratio": got / model_s})  # fmt: skip
    wide = [r["bytes"] / (r["measured_us"] / 1e6) for r in launches
            if r["programs"] >= SMS and r["bytes"] > 8e6]  # fmt: skip
    few = [r["bytes"] / (r["measured_us"] / 1e6) / r["programs"] for r in launches
           if r["programs"] < SMS and r["bytes"] > 1e6]  # fmt: skip
    small = sorted(r["measured_us"] for r in launches)[: max(1, len(launches) // 5)]
    return {"width": "tiny" if ARGS.tiny else width, "device": device,
            "name": torch.cuda.get_device_name(0) if CUDA else "cpu (interpreter)",
            "launches": launches,
            "fitted": {"bandwidth_Bps": statistics.median(wide) if wide else None,
                       "program_rate_Bps": statistics.median(few) if few else None,
                       "floor_us": statistics.median(small)},
            "model": {"bandwidth_Bps": H200.bandwidth, "program_rate_Bps": H200.program_rate,
                      "floor_us": H200.kernel * 1e6}}  # fmt: skip


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="append each width's row here (JSON lines)")
    ap.add_argument("--tiny", action="store_true", help="hidden 32, L 64, in the interpreter")
    ARGS = ap.parse_args()
    for width in ARGS.widths[:1] if ARGS.tiny else ARGS.widths:
        row = measure(width)
        for r in row["launches"]:
            print(f"{row['width']:5s} {r['kernel']:24s} {r['programs']:6d} programs "
                  f"{r['bytes'] / 1e6:8.2f} MB {r['measured_us']:9.1f} us measured "
                  f"{r['modelled_us']:9.1f} modelled ({r['ratio']:.2f}x)")  # fmt: skip
        print(f"{row['width']}: fitted {row['fitted']} vs the model's {row['model']}", flush=True)
        if ARGS.out:
            with Path(ARGS.out).open("a") as f:
                f.write(json.dumps(row) + "\n")
    sys.stdout.flush()


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
