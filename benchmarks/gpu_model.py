"""The protected training step on a GPU, modelled from its op trace on this machine
(``../shared/spec/gpu-path.md`` §7; :class:`attnchecker.gpu_cost.OpTrace`): every figure here is
**modelled**, not measured.

Each launching op of one training step (forward, backward, AdamW with ``foreach`` as on CUDA) is
recorded with its FLOPs and bytes; on the device it takes max(bytes / 4.0 TB/s, FLOPs / 700
TFLOP/s, 3 us), on the host 20 us in eager and nothing in a CUDA graph; an eager step is the
slower of the two sums, a graph step the device's.

- **Calibration**: llama and gpt2 at base width (hidden 768, 2 layers, L 1024, B 1, bf16
  autocast, the checks as eager ops), traced on real tensors here, the plain SDPA model and the
  default config, against the H200's measured step times in
  ``results/protect_vs_sdpa_eager_checks_cuda_2026-12-04.json`` (the same configuration): the
  model's error on each.
- **Llama-8B widths** (hidden 4096, 32 heads, 8 KV heads, MLP 14336, head dim 128, 2 layers,
  L 4096, B 1, vocabulary 128), traced under ``FakeTensorMode`` (shapes only): the plain SDPA
  model, the default config, the projections' checks alone (``ops`` = the projection part of
  the op table) and ``all_linear``, with the checks as eager ops and as the registered Triton
  ops (the ``_triton`` arms: ``check_impl="triton"``, what ``auto`` runs on CUDA); the core's
  checks alone on the eager core and on the SDPA route, and the default config as ``auto``
  runs it on CUDA (``protected_sdpa``: the SDPA route and the Triton ops); eager and
  CUDA-graph step times and overheads; the same at base width (L 1024); and one checked dX
  GEMM (T 8192, 2304 -> 768) by the registered ops.

    python benchmarks/gpu_model.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("ATTNCHECKER_CHECK_IMPL", "eager")  # as the H200 run measured
# the "_triton" arms' registered ops, traced by their fake implementations (no kernel runs)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from _common import RESULTS, environment, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.attention.ops import CORE_OPS, OP_TABLE
from attnchecker.gpu_cost import H200, LLAMA_8B, OpTrace, traced_step
from attnchecker.models.tiny import build

MEASURED = RESULTS / "protect_vs_sdpa_eager_checks_cuda_2026-12-04.json"
PROJECTIONS = tuple(o.name for o in OP_TABLE if o.part == "projection")
ARMS = {
    "protected": ABFTConfig(),
    "projections": ABFTConfig(ops=PROJECTIONS),
    "all_linear": ABFTConfig(scope="all_linear"),
    # the GEMM checks as registered Triton ops (issue 42; "auto" on CUDA), the rest as before
    "protected_triton": ABFTConfig(check_impl="triton"),
    "projections_triton": ABFTConfig(ops=PROJECTIONS, check_impl="triton"),
    "all_linear_triton": ABFTConfig(ops=PROJECTIONS, scope="all_linear", check_impl="triton"),
    # the attention core's checks alone: the eager core, and the SDPA route (issue 43)
    "core": ABFTConfig(ops=CORE_OPS),
    "core_sdpa": ABFTConfig(ops=CORE_OPS, backend="sdpa", check_impl="triton"),
    # the default config as "auto" runs it on CUDA: the SDPA route, the GEMM checks' Triton ops
    "protected_sdpa": ABFTConfig(backend="sdpa", check_impl="triton"),
    "all_linear_sdpa": ABFTConfig(backend="sdpa", check_impl="triton", scope="all_linear"),
}
NATIVE_GQA = {"protected_sdpa_gqa": "protected_sdpa", "all_linear_sdpa_gqa": "all_linear_sdpa"}
"""Arms traced as if the flash kernel took K / V of fewer heads as they are (``probe_gqa`` on the
device decides; until a GPU says so, the route expands them)."""
WIDE_ARMS = ["protected_sdpa", "protected_sdpa_gqa", "all_linear_sdpa", "all_linear_sdpa_gqa",
             "core_sdpa", "projections_triton"]  # fmt: skip
"""What CUDA runs (``auto``): the arms of the wide tables."""


def trace(family: str, config: ABFTConfig | None, L: int) -> OpTrace:
    """The op trace of one training step computed for real (the second: the first builds what
    is cached) of a 2-layer ``family`` model, plain SDPA (``config`` None) or protected by
    ``config``: the calibration's, which runs on this machine."""
    torch.manual_seed(0)
    model = build(family, ARGS.size, layers=2, max_len=max(L, 128))
    model.config.use_cache = False
    model.train()
    model.set_attn_implementation("sdpa")  # what users run, and what protection starts from
    if config is not None:
        protect_(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(3, 128, (1, L), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with OpTrace() as t:
        step()
    return t


def calibration() -> list[dict]:
    measured = {r["family"]: r for r in json.loads(MEASURED.read_text())["rows"]}
    rows = []
    for family in ARGS.families:
        for arm, config in (("sdpa", None), ("protected", ARMS["protected"])):
            m = trace(family, config, ARGS.calibrate_length).modelled(H200)
            got = measured.get(family, {}).get(f"step_{arm}_ms")
            rows.append({"family": family, "arm": arm, "launches": m.launches,
                         "host_ms": m.host * 1e3, "device_ms": m.device * 1e3,
                         "modelled_ms": m.step() * 1e3, "measured_ms": got,
                         "error": None if got is None else m.step() * 1e3 / got - 1})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def _row(arm: str, m, plain, extra=None) -> dict:
    return {"arm": arm, "launches": m.launches, "host_ms": m.host * 1e3,
            "device_ms": m.device * 1e3, "eager_ms": m.step() * 1e3,
            "graph_ms": m.step(graph=True) * 1e3,
            "eager_vs_sdpa": m.step() / plain.step() - 1,
            "graph_vs_sdpa": m.step(graph=True) / plain.step(graph=True) - 1,
            "top": "" if extra is None else _top(extra)}  # fmt: skip


def _scaled(t1, t2, n: int):
    """A step of ``n`` layers from the traces of 1 and 2: fixed + n x (the second layer's)."""
    from attnchecker.gpu_cost import Modelled

    a, b = t1.modelled(H200), t2.modelled(H200)
    return Modelled(a.launches + (n - 1) * (b.launches - a.launches),
                    a.host + (n - 1) * (b.host - a.host),
                    a.device + (n - 1) * (b.device - a.device))  # fmt: skip


def wide(widths: dict | None, L: int, layers: int, vocab: int, arms, micro: int = 1) -> list[dict]:
    """Each arm's step of ``layers`` layers, from traces of 1 and 2 (shapes only, real
    tensors, nothing computed: ``gpu_cost.traced_step``), against the plain SDPA model's."""

    def both(config, native_gqa=False):
        return [traced_step(config, layers=n, L=L, vocab=vocab, widths=widths,
                            micro_batches=micro, native_gqa=native_gqa)
                for n in (1, 2)]  # fmt: skip

    p1, p2 = both(None)
    plain = _scaled(p1, p2, layers)
    base = p2.device_time(H200)
    base.subtract(p1.device_time(H200))
    rows = [_row("sdpa", plain, plain)]
    print(rows[-1], flush=True)
    for arm in arms:
        t1, t2 = both(ARMS[NATIVE_GQA.get(arm, arm)], arm in NATIVE_GQA)
        extra = t2.device_time(H200)
        extra.subtract(t1.device_time(H200))
        extra.subtract(base)  # what one protected layer adds on the device
        rows.append(_row(arm, _scaled(t1, t2, layers), plain, extra))
        print(rows[-1], flush=True)
    return rows


def one_gemm() -> list[dict]:
    """One checked dX GEMM of the spec's measurement (T 8192, N 2304 -> K 768, bf16) by the
    registered ops, with W's references at hand (the step's weight sums) and with its own
    references pass, against the GEMM itself: shapes only, the Triton launches recorded."""
    from attnchecker.kernels import gemm_check as gc
    from attnchecker.kernels.launches import SkipCompute, recorded

    rows = []
    T, N, K = (64, 96, 32) if ARGS.quick else (8192, 2304, 768)
    dy, w = torch.empty(T, N, dtype=torch.bfloat16), torch.empty(N, K, dtype=torch.bfloat16)
    dx = torch.empty(T, K, dtype=torch.bfloat16)
    rec, step = torch.zeros(7, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    with SkipCompute(), recorded(run=False):
        refs = gc.gemm_refs(w)
        with OpTrace() as t:
            dy @ w
        gemm = t.modelled(H200)
        for arm, kw in (("W's references at hand", {"refs": refs}), ("own references", {})):
            with OpTrace() as t:
                gc.check_(dx, dy, w, rec, step, floor=0.0, a=4e-3, c=-1e-3, cap=48.0, **kw)
            m = t.modelled(H200)
            rows.append({"arm": arm, "shape": [T, N, K], "launches": m.launches,
                         "host_us": m.host * 1e6, "device_us": m.device * 1e6,
                         "gemm_device_us": gemm.device * 1e6})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def _top(times, n: int = 5) -> str:
    """The ``n`` ops with the most modelled device time (ms)."""
    return ", ".join(f"{op.removeprefix('aten.')} {t * 1e3:.1f}"
                     for op, t in times.most_common(n))  # fmt: skip


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def markdown(cal: list[dict], tables: list[tuple[str, list[dict]]], one: list[dict], env: dict,
             cmd: str) -> str:  # fmt: skip
    out = [
        "# The protected step on an H200, **modelled** from op traces (not measured)",
        "",
        f"`{cmd}`; torch {env['torch']}, {env['date']}. Model (`attnchecker.gpu_cost`, "
        f"`H200`): per aten op max(bytes / {H200.bandwidth / 1e12:.1f} TB/s, FLOPs / "
        f"{H200.flops / 1e12:.0f} TFLOP/s, {H200.kernel * 1e6:.0f} us) on the device; per Triton "
        f"launch max(bytes / min({H200.bandwidth / 1e12:.1f} TB/s, programs x "
        f"{H200.program_rate / 1e9:.0f} GB/s), {H200.kernel * 1e6:.0f} us), a repair on a clean "
        "step its flags' bytes; "
        f"{H200.launch * 1e6:.0f} us on the host per launch in eager, none in a CUDA graph; "
        "eager step = max(host, device). One training step: forward and backward (of each "
        "micro-batch), AdamW foreach, the records drained; bf16 autocast over fp32 weights. "
        "Traced on real tensors with nothing computed (`gpu_cost.traced_step`: both arms the "
        "same way, the GPU's path where it differs, the registered ops' own aten ops and "
        "Triton launches charged), a step of n layers as fixed + n x the second layer's. "
        "Arms: `protected_sdpa`, the default config as `auto` runs it on CUDA (the SDPA route, "
        "the GEMM checks as registered Triton ops); `all_linear_sdpa`, the same with "
        '`scope="all_linear"`; `_gqa`: the same if the flash kernel takes K / V of fewer heads '
        "as they are (the route probes it on the device, `sdpa_backend.probe_gqa`; else it "
        "expands them: two copies forward, two and two group sums backward); `core_sdpa`, "
        "the attention core's checks alone; "
        "`projections_triton`, the projections' checks alone (eager core). A CUDA graph's step "
        "stands in for a compiled one (launch cost gone; inductor's own fusion not modelled). "
        "What the model cannot see: `attnchecker.gpu_cost`'s docstring (device constants not "
        "fitted to kernel timings; per-program rate assumed).",
        "",
        f"## Calibration: base width, 2 layers, L {ARGS.calibrate_length}, B 1, computed, "
        f"against the H200's measured steps (`{MEASURED.name}`)",
        "",
        "| family | arm | launches | host ms | device ms | modelled ms | measured ms | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cal:
        got = "" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        out.append(f"| {r['family']} | {r['arm']} | {r['launches']} | {r['host_ms']:.1f} | "
                   f"{r['device_ms']:.1f} | {r['modelled_ms']:.1f} | {got} | "
                   f"{_pct(r['error'])} |")  # fmt: skip
    for title, rows in tables:
        out += [
            "",
            f"## {title} (modelled)",
            "",
            "| arm | launches | host ms | device ms | eager ms | vs SDPA | CUDA graph ms | "
            "vs SDPA | most device ms a layer adds |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            out.append(f"| {r['arm']} | {r['launches']} | {r['host_ms']:.1f} | "
                       f"{r['device_ms']:.1f} | {r['eager_ms']:.1f} | "
                       f"{_pct(r['eager_vs_sdpa'])} | {r['graph_ms']:.1f} | "
                       f"{_pct(r['graph_vs_sdpa'])} | {r['top']} |")  # fmt: skip
    T, N, K = one[0]["shape"]
    out += [
        "",
        f"## One checked dX GEMM, T {T} x N {N} -> K {K}, bf16, registered ops (modelled)",
        "",
        f"The GEMM itself: {one[0]['gemm_device_us']:.1f} us on the device.",
        "",
        "| check | launches | host us (eager) | device us |",
        "|---|---:|---:|---:|",
    ]
    out += [f"| {r['arm']} | {r['launches']} | {r['host_us']:.1f} | {r['device_us']:.1f} |"
            for r in one]  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["llama", "gpt2"])
    ap.add_argument("--size", default="base")
    ap.add_argument("--calibrate-length", type=int, default=1024)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--arms", nargs="+", default=WIDE_ARMS, choices=[*ARMS, *NATIVE_GQA])
    ap.add_argument("--micro", type=int, default=4,
                    help="micro-batches a step (its own table; 1: none)")  # fmt: skip
    ARGS = parse(ap, {"size": "tiny", "calibrate_length": 64, "length": 64,
                      "families": ["llama"]})  # fmt: skip
    env = environment()
    cal = calibration()
    q = ARGS.quick
    widths, layers, vocab = ({}, 2, 128) if q else (LLAMA_8B, 32, 128256)
    name = "base width" if q else "Llama-8B widths (hidden 4096, 32 heads, 8 KV heads, MLP 14336)"
    tables = [
        (f"llama, {name}, {layers} layers, vocabulary {vocab}, L {ARGS.length}, B 1",
         wide(widths, ARGS.length, layers, vocab, ARGS.arms)),
    ]  # fmt: skip
    if ARGS.micro > 1:
        tables.append((f"the same, gradient accumulation {ARGS.micro} micro-batches a step",
                       wide(widths, ARGS.length, layers, vocab, ["protected_sdpa"],
                            micro=ARGS.micro)))  # fmt: skip
    tables.append((f"llama, base width, 2 layers, vocabulary 128, L {ARGS.calibrate_length}, B 1",
                   wide({}, ARGS.calibrate_length, 2, 128, ARGS.arms)))  # fmt: skip
    one = one_gemm()
    from _common import command

    write("gpu_model", {"environment": env, "args": vars(ARGS), "calibration": cal,
                        "tables": tables, "one_gemm": one},
          markdown(cal, tables, one, env, command()))  # fmt: skip


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
