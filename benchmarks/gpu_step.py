"""The protected training step where users train: the plain SDPA model, the attention core's
checks alone, the default config (on CUDA the SDPA route), the projections' checks alone and
``all_linear`` (the checks as ``check_impl="auto"`` runs them: on CUDA the GEMM checks' and the
route's registered Triton ops), eager, compiled and as a CUDA graph, at base
width and at Llama-8B widths, the arms alternated in one process. The first stage of
``scripts/gpu_check.sh``.

Each row (one width x mode) is printed and appended to ``--out`` (JSON lines) the moment it is
measured, so a stage killed by its timeout keeps what it measured; a mode that fails for an arm
(a CUDA graph protection cannot be captured in yet, spec gpu-path §6) is a row that says why.
Widths: ``base`` (hidden 768, 12 heads, L 1024) and ``8b`` (hidden 4096, 32 heads, 8 KV heads,
MLP 14336, head dim 128, L 4096); 2 llama layers, B 1, vocabulary 128, bf16 autocast, AdamW
(fused, and capturable for the graph). ``--tiny``: hidden 32 at L 32, for the CPU test of this
script (``tests/integration/test_gpu_stage.py``).

    python benchmarks/gpu_step.py [--widths base 8b] [--modes eager compiled graph]
        [--arms sdpa core protected projections all_linear] [--reps 10] [--out rows.jsonl]
        [--tiny]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import alternate
from attnchecker import ABFTConfig, protect_
from attnchecker.attention.ops import CORE_OPS, OP_TABLE
from attnchecker.models.tiny import build

WIDTHS = {
    "base": ({}, 1024),
    "8b": ({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "head_dim": 128}, 4096),
}  # fmt: skip
ARMS = {
    "sdpa": None,
    # the attention core's checks alone on the default engine (on CUDA the SDPA route: issue
    # 43's target of +1%)
    "core": ABFTConfig(ops=CORE_OPS),
    # the default config (on CUDA: the SDPA route and the GEMM checks' Triton ops)
    "protected": ABFTConfig(),
    # the projection part of the op table alone: the model's own SDPA runs (issue 42's target)
    "projections": ABFTConfig(ops=tuple(o.name for o in OP_TABLE if o.part == "projection")),
    "all_linear": ABFTConfig(scope="all_linear"),
}


def _base(widths: dict, L: int) -> torch.nn.Module:
    """The 2-layer llama every arm copies, on the CPU, in train mode."""
    torch.manual_seed(0)
    model = build("llama", "tiny" if ARGS.tiny else "base", layers=2, max_len=max(L, 128),
                  **widths)  # fmt: skip
    model.config.use_cache = False
    return model.train()


def _arm(base: torch.nn.Module, arm: str, device: str) -> torch.nn.Module:
    """A copy of ``base`` on ``device`` in SDPA attention, protected as ``arm`` asks."""
    model = copy.deepcopy(base).to(device)
    model.set_attn_implementation("sdpa")  # what users run, and what protection starts from
    if ARMS[arm] is not None:
        protect_(model, ARMS[arm])
    return model


def _stepper(model, ids, mode: str, device: str):
    """One training step of ``model`` in ``mode``: a callable."""
    graph = mode == "graph"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda",
                            capturable=graph)  # fmt: skip
    run = torch.compile(model) if mode == "compiled" else model

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not graph)

    if not graph:
        return step
    if device != "cuda":
        raise RuntimeError("a CUDA graph needs a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream, as capture requires
            step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def measure(width: str, mode: str, device: str) -> dict:
    widths, L = WIDTHS[width]
    if ARGS.tiny:
        widths, L = {}, 32
    t0 = time.perf_counter()
    base = _base(widths, L)
    ids = torch.randint(3, 128, (1, L), generator=torch.Generator().manual_seed(0)).to(device)
    steps, errors = {}, {}
    for arm in ARGS.arms:
        try:
            steps[arm] = _stepper(_arm(base, arm, device), ids, mode, device)
            steps[arm]()  # the first step: compilation, caches
        except Exception as e:  # a row that says why (capture, compile), not a dead stage
            errors[arm] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc(file=sys.stderr)
    times = alternate(steps, ARGS.reps, warmup=0)  # alternated, call by call
    row = {"width": width, "L": L, "mode": mode, "device": device, "reps": ARGS.reps,
           "setup_s": round(time.perf_counter() - t0, 1), "errors": errors,
           "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}}  # fmt: skip
    if "sdpa" in times:
        row["vs_sdpa"] = {k: statistics.median(a / b for a, b in zip(v, times["sdpa"], strict=True))
                          - 1 for k, v in times.items() if k != "sdpa"}  # fmt: skip
    return row


def main() -> None:
    global ARGS
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    ap.add_argument("--modes", nargs="+", default=["eager", "graph", "compiled"],
                    choices=["eager", "compiled", "graph"])  # fmt: skip
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="append each row here (JSON lines)")
    ap.add_argument("--tiny", action="store_true", help="hidden 32, L 32 (the CPU test)")
    ARGS = ap.parse_args()
    out = Path(ARGS.out) if ARGS.out else None
    for mode in ARGS.modes:  # most telling first: eager at each width, then graph, compiled
        for width in ARGS.widths:
            try:
                row = measure(width, mode, ARGS.device)
            except Exception as e:  # out of memory at a width, ...: the next row still runs
                row = {"width": width, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}
                traceback.print_exc(file=sys.stderr)
            line = json.dumps(row)
            print(line, flush=True)
            if out is not None:
                with out.open("a") as f:
                    f.write(line + "\n")
            if ARGS.device == "cuda":
                torch.cuda.empty_cache()


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
