"""Smallest error the backward's checks detect, and their false alarms, per dtype.

The checks of ``attnchecker.attention.grads`` as the backward runs them, at attention shapes
(T = 1024 tokens, hidden 768; B 8, H 12, L 128, d 64): a projection's dX = dY W and
dW = dY^T X (``product_check_``: rows and columns, a per-matrix Frobenius magnitude bound),
the core's dQ = dS K (``product_residual`` by rows, dS signed) and dV = P^T dO (P >= 0: an
exact per-row bound). Operands: X ~ N(0, 1), W ~ N(0, 0.02^2) (GPT-2's init), dY ~ N(0, s^2)
with s = 1e-3, softmax probabilities of N(0, 1) logits, dS = P (dP - rowsum(P dP)) as softmax's
backward makes it.

The checks run as ``ABFTConfig()`` (the default) runs them: ``tolerance_scale`` 1 (``scale=1.0``)
and ``max_rows`` 4.

1. False alarms: ``--clean`` clean products per GEMM and dtype (500: about 0.3 / 0.5 / 0.9 s
   per case in fp32 / bf16 / fp16 on 2 cores, CPU fp16 GEMMs being slow), flagged or not.
2. Sensitivity: one element of every checked row changed by delta = r * ||row||_1 (random
   sign and position, in the output's dtype), r on a half-decade grid 1e-8 .. 1e2; reported:
   the smallest r from which every faulty row is flagged (the row's own L1 norm as the unit,
   as ``check_sensitivity.py`` reports the forward's).

The SDPA route's backward checks (``backend="sdpa"``, ``attnchecker.kernels.sdpa_check``) on
the backend's own backward (the CPU flash kernel, causal, B 8, H 12, L 128, d 64, q / k / v ~
N(0, 1), dO ~ N(0, 1e-3^2)): dV's and dK's exact column sums per head and dQ's bound. One element
of one row of each (batch, head) matrix moved by r x that row's L1 norm; reported: the smallest r
from which every head is flagged, and false alarms over the clean cases. The same faults against
the sampled rows' per-element checks (``sampled_rows``, ``attnchecker.kernels.sdpa_sample``)
with every query and key row sampled: what a call sees in the rows it samples.

    python benchmarks/backward_sensitivity.py [--clean 500] [--device cuda] [--quick]

On a GPU (``--device cuda``, ``scripts/gpu_check.sh``'s ``backward`` stage) the same rows come
from the device's own GEMMs and SDPA kernels: the margins the CPU cannot show (cuBLAS's and the
flash kernel's accumulation orders, the sampled rows' bounds against CUDA's dK / dV sums).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor

from _common import command, environment, parse, write
from attnchecker.attention.grads import product_check_, product_residual
from attnchecker.kernels import sdpa_backend, sdpa_check, sdpa_sample

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = torch.device("cpu")  # --device: where the GEMMs and the SDPA kernels run
SHAPES = {"T": 1024, "K": 768, "N": 768, "B": 8, "H": 12, "L": 128, "d": 64}  # --quick: TINY
TINY = {"T": 64, "K": 64, "N": 64, "B": 1, "H": 2, "L": 64, "d": 16}
GRID = [10.0 ** (e / 2) for e in range(-16, 5)]


def _draw(g: torch.Generator) -> dict[str, Tensor]:
    """The operands in fp32 (each dtype's case is their rounding: one draw serves all three)."""
    T, K, N, B, H, L, d = (SHAPES[n] for n in "TKNBHLd")
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.02
    dy = torch.randn(T, N, generator=g) * 1e-3
    p = torch.randn(B, H, L, L, generator=g).softmax(-1)
    dp = torch.randn(B, H, L, L, generator=g) * 1e-3
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    k = torch.randn(B, H, L, d, generator=g)
    do = torch.randn(B, H, L, d, generator=g) * 1e-3
    drawn = {"x": x, "w": w, "dy": dy, "p": p, "ds": ds, "k": k, "do": do}
    return {n: t.to(DEVICE) for n, t in drawn.items()}


def _operands(dtype: torch.dtype, g: torch.Generator) -> dict[str, Tensor]:
    return {n: t.to(dtype) for n, t in _draw(g).items()}


def _gemms(o: dict[str, Tensor]):
    """(name, out, x, y, kind) of each checked backward GEMM: out = x @ y."""
    return [
        ("dX = dY W", o["dy"] @ o["w"], o["dy"], o["w"], "linear"),
        ("dW = dY^T X", o["dy"].t() @ o["x"], o["dy"].t(), o["x"], "linear"),
        ("dX (registered ops)", o["dy"] @ o["w"], o["dy"], o["w"], "kernels"),
        ("dW (registered ops)", o["dy"].t() @ o["x"], o["dy"].t(), o["x"], "kernels"),
        ("dQ = dS K", o["ds"] @ o["k"], o["ds"], o["k"], "heads"),
        ("dV = P^T dO", o["p"].mT @ o["do"], o["p"].mT, o["do"], "heads+"),
    ]


def _flags(out: Tensor, x: Tensor, y: Tensor, kind: str) -> Tensor:
    """Per-row flags of the check (for a linear, rows flagged before the repair)."""
    if kind == "linear":
        from attnchecker.abft.gemm import rows_excess

        return ~(rows_excess(out, x, y, scale=1.0) <= 0)
    if kind == "kernels":  # check_impl="triton" (the CUDA default): the verify kernel's excesses
        from attnchecker.abft.gemm import limits  # as gemm_check.reference computes them (held
        from attnchecker.kernels import gemm_check as gc  # equal by test_gemm_check.py)

        floor, a, c, cap, *_ = limits(out, x, y, 1.0)
        return ~(gc.reference(out, x, y, floor=floor, a=a, c=c, cap=cap)["exc"] <= 0)
    return ~(product_residual(out, x, y, scale=1.0, nonneg=kind == "heads+")[1] <= 0)


def _clean(n: int) -> dict[str, dict[str, int]]:
    """Flagged clean products per dtype and GEMM over ``n`` seeded draws."""
    alarms: dict[str, dict[str, int]] = {d: {} for d in DTYPES}
    for seed in range(n):
        drawn = _draw(torch.Generator().manual_seed(seed))
        for dname, dtype in DTYPES.items():
            ops = {k: t.to(dtype) for k, t in drawn.items()}
            for name, out, x, y, kind in _gemms(ops):
                if kind == "linear":
                    rec = product_check_(out.clone(), x, y, max_rows=4, scale=1.0)
                    bad = bool(rec[0, 0] > 0 or rec[0, 1] > 0)
                else:
                    bad = bool(_flags(out, x, y, kind).any())
                alarms[dname][name] = alarms[dname].get(name, 0) + bad
        if (seed + 1) % 50 == 0:
            print(f"  {seed + 1} / {n} clean cases: {alarms}", flush=True)
    return alarms


def _sensitivity(dtype: torch.dtype) -> dict[str, float | None]:
    g = torch.Generator().manual_seed(1234)
    found: dict[str, float | None] = {}
    for name, out, x, y, kind in _gemms(_operands(dtype, g)):
        rows = out.reshape(-1, out.shape[-1])
        n = rows.shape[0]
        cols = torch.randint(0, rows.shape[1], (n,), generator=g)
        sign = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(DEVICE)
        l1 = rows.float().abs().sum(-1)
        found[name] = None
        for r in GRID:
            faulty = rows.clone()
            idx = torch.arange(n)
            faulty[idx, cols] = (rows[idx, cols].float() + sign * r * l1).to(dtype)
            changed = faulty[idx, cols] != rows[idx, cols]
            flags = _flags(faulty.view(out.shape), x, y, kind).reshape(-1)
            if bool(flags[changed].all()) and bool(changed.all()):
                found[name] = r
                break
    return found


ROUTE = ("dQ (sdpa route)", "dK (sdpa route)", "dV (sdpa route)")
SAMPLED = ("dQ (sampled row)", "dK (sampled row)", "dV (sampled row)")


def _route_case(dtype: torch.dtype, g: torch.Generator):
    """A causal attention's backward by the CPU flash kernel: (inputs of the checks, grads)."""
    B, H, L, d = (SHAPES[n] for n in "BHLd")
    q, k, v = (torch.randn(B, H, L, d, generator=g).to(DEVICE, dtype) for _ in range(3))
    out, lse, aux = sdpa_backend.attention_forward(q, k, v, None, True, d**-0.5)
    grad = (torch.randn(B, H, L, d, generator=g) * 1e-3).to(DEVICE, dtype)
    dq, dk, dv = sdpa_backend.attention_backward(grad, q, k, v, out, lse, None, True, d**-0.5, aux)
    return (q, k, v, lse, grad, out), [dq, dk, dv]


def _route_flags(ins, grads, sampled: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(B, H) flags of dQ's bound, dK's sum and dV's sum; ``sampled``: of the sampled rows'
    per-element checks (``sampled_rows``), every query and key row sampled: what the check sees
    in a row it samples."""
    q, k, v, lse, grad, out = ins
    if sampled:
        B, H, L, d = q.shape
        every = torch.arange(L, device=DEVICE).expand(B, H, L)
        bad = sdpa_sample._bwd_sample_flags(q, k, v, None, out, lse, grad, *grads,
                                            torch.zeros(1, 1, 1, device=DEVICE), True,
                                            d**-0.5, 1.0, every,
                                            every)  # fmt: skip
        return tuple(b.flatten(2).any(-1) for b in bad[:3])
    stats = sdpa_check.kv_stats(k, v)
    bad = sdpa_check._bwd_flags(q, k, v, lse, grad, *grads, stats,
                                torch.zeros(1, 1, 1, device=DEVICE),
                                q.shape[-1] ** -0.5, 1.0)  # fmt: skip
    return bad[0].flatten(2).any(-1), bad[1].any(-1), bad[2].any(-1)


def _route_sensitivity(dtype: torch.dtype, sampled: bool = False) -> dict[str, float | None]:
    g = torch.Generator().manual_seed(1234)
    ins, grads = _route_case(dtype, g)
    found: dict[str, float | None] = {}
    for i, name in enumerate(SAMPLED if sampled else ROUTE):
        t = grads[i]
        B, H, L, d = t.shape
        rows = torch.randint(0, L, (B, H), generator=g)
        cols = torch.randint(0, d, (B, H), generator=g)
        sign = (torch.randint(0, 2, (B, H), generator=g) * 2 - 1).to(DEVICE)
        b, h = torch.meshgrid(torch.arange(B), torch.arange(H), indexing="ij")
        l1 = t[b, h, rows].float().abs().sum(-1)  # (B, H): the faulty rows' L1 norms
        found[name] = None
        for r in GRID:
            faulty = [x.clone() for x in grads]
            was = t[b, h, rows, cols]
            faulty[i][b, h, rows, cols] = (was.float() + sign * r * l1).to(dtype)
            changed = faulty[i][b, h, rows, cols] != was
            if bool(changed.all()) and bool(_route_flags(ins, faulty, sampled)[i].all()):
                found[name] = r
                break
    return found


def _route_clean(n: int) -> dict[str, dict[str, int]]:
    """Clean backward passes whose route checks (and sampled rows, every row) flag a head, per
    dtype and check."""
    alarms = {d: dict.fromkeys(ROUTE + SAMPLED, 0) for d in DTYPES}
    for seed in range(n):
        for dname, dtype in DTYPES.items():
            ins, grads = _route_case(dtype, torch.Generator().manual_seed(seed))
            for names, sampled in ((ROUTE, False), (SAMPLED, True)):
                for name, flags in zip(names, _route_flags(ins, grads, sampled), strict=True):
                    alarms[dname][name] += bool(flags.any())
    return alarms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clean", type=int, default=500, help="clean cases per GEMM and dtype")
    ap.add_argument("--device", default="cpu", help="where the GEMMs and the SDPA kernels run "
                    "(cuda: the device's own GEMMs and flash / memory-efficient kernels)")  # fmt: skip
    args = parse(ap, quick={"clean": 2})
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.quick:  # a smoke run of every path (gpu_check.sh's tiny stage): small shapes
        SHAPES.update(TINY)
    env = environment()
    t0 = time.perf_counter()
    rows = {dname: {"smallest": _sensitivity(dtype) | _route_sensitivity(dtype)
                    | _route_sensitivity(dtype, sampled=True)}
            for dname, dtype in DTYPES.items()}  # fmt: skip
    route = _route_clean(max(1, args.clean // 10))
    for dname, alarms in _clean(args.clean).items():
        rows[dname]["false_alarms"] = alarms | route[dname]
        print(dname, rows[dname], flush=True)
    elapsed = time.perf_counter() - t0
    names = list(rows["fp32"]["smallest"])
    lines = [
        "# The backward's checks: false alarms and smallest detected error",
        "",
        f"`{command()}`; torch {env['torch']}, {env['threads']} threads, on {DEVICE.type}, "
        f"{env['date']}, "
        f"{elapsed:.0f} s. The checks as `ABFTConfig()` (the default) runs them "
        "(tolerance_scale 1, max_rows 4). Smallest r (one element changed by r x its row's L1 "
        f"norm) from which every faulty row is flagged, and false alarms in {args.clean} clean "
        "products per GEMM and dtype. The SDPA route's rows: a head flagged, one fault per "
        f"(batch, head) matrix, false alarms in {max(1, args.clean // 10)} clean backward "
        f"passes ({SHAPES['B'] * SHAPES['H']} heads each). The sampled rows' (`sampled_rows=s`, "
        "opt-in): the same faults "
        "seen by the per-element check of a sampled row, every row sampled (a call samples s "
        "of L per head: a fault is seen in the call with probability s / L).",
        "",
        "| GEMM | " + " | ".join(f"{d} smallest r | {d} false alarms" for d in DTYPES) + " |",
        "|---|" + "---|---|" * len(DTYPES),
    ]
    for name in names:
        cells = []
        for d in DTYPES:
            r = rows[d]["smallest"][name]
            n = max(1, args.clean // 10) if name in ROUTE + SAMPLED else args.clean
            cells += ["not within 1e2" if r is None else f"{r:.1e}",
                      f"{rows[d]['false_alarms'][name]} / {n}"]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    payload = {"environment": env, "args": vars(args), "seconds": elapsed, "rows": rows}
    write("backward_sensitivity", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
