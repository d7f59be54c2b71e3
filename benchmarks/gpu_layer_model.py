"""What one protected layer adds to a training step on an H200, **modelled** (not measured) from
the traces of a 1- and a 2-layer llama (``attnchecker.gpu_cost.traced_step``: real tensors,
nothing computed, the GPU's path, the registered ops' own ops and Triton launches by grid),
the second layer's time against the plain SDPA model's second layer: the overhead of a deep
model's step less its embedding, head and optimizer (which the default config does not check),
so an upper bound of the whole step's. Vocabulary 128 (the head out of the way), B 1, bf16
autocast over fp32 weights, eager (host and device overlap) and as a CUDA graph. Arms: the
default config as CUDA runs it (the SDPA route, the GEMM checks' registered Triton ops) and
``all_linear``, each with K / V expanded for GQA (the route's path until the device's flash
kernel is found to take GQA: ``sdpa_backend.probe_gqa``) and with the flash kernel's own GQA.

Then a layer of GPT-2 and BERT at base width with their attention dropout on (the route's
dropout calls, the eager engine's before).

    python benchmarks/gpu_layer_model.py [--quick]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from _common import environment, parse, write
from attnchecker import ABFTConfig
from attnchecker.gpu_cost import H200, LLAMA_8B, traced_step

ARMS = {
    "default": (ABFTConfig(backend="sdpa", check_impl="triton"), False, 1),
    "default, flash's own GQA": (ABFTConfig(backend="sdpa", check_impl="triton"), True, 1),
    "default, 4 micro-batches a step": (ABFTConfig(backend="sdpa", check_impl="triton"), False, 4),
    "all_linear": (ABFTConfig(backend="sdpa", check_impl="triton", scope="all_linear"), False, 1),
    "all_linear, flash's own GQA": (
        ABFTConfig(backend="sdpa", check_impl="triton", scope="all_linear"), True, 1),
    "all_linear, 4 micro-batches a step": (
        ABFTConfig(backend="sdpa", check_impl="triton", scope="all_linear"), False, 4),
}  # fmt: skip
"""(config, the flash kernel's own GQA, micro-batches a step: gradient accumulation, the weight
sums once a step)."""


DROPOUT_ARMS = {
    "the SDPA route (default)": ABFTConfig(backend="sdpa", check_impl="triton"),
    "the eager engine (before issue 54)": ABFTConfig(backend="eager", check_impl="triton"),
}
"""The families that train with attention dropout (GPT-2, BERT): the route keeps them (a host
read a repair op) where they used to fall back to the eager engine."""


def layer(config, native: bool, widths: dict, L: int, family: str = "llama",
          batch: int = 1, micro: int = 1) -> tuple[float, float, int, dict, int]:  # fmt: skip
    """(device s, host s, launches) of the second layer in a step of ``micro`` micro-batches,
    its device time by op, and its host reads (each stalls the device: ``H200.sync``)."""
    a, b = (traced_step(config, family=family, layers=n, L=L, vocab=128, widths=widths,
                        native_gqa=native, batch=batch, micro_batches=micro)
            for n in (1, 2))  # fmt: skip
    ma, mb = a.modelled(H200), b.modelled(H200)
    by_op = b.device_time(H200)
    by_op.subtract(a.device_time(H200))
    return (mb.device - ma.device, mb.host - ma.host, mb.launches - ma.launches, by_op,
            mb.syncs - ma.syncs)  # fmt: skip


def dropout_rows(L: int = 1024, batch: int = 8) -> list[dict]:
    """A layer of GPT-2 and BERT at base width with their attention dropout (0.1), eager: the
    plain model's CUDA kernels draw it (flash, memory-efficient with BERT's padding mask)."""
    rows = []
    for family in ("gpt2", "bert"):
        pd, ph, _pn, _pby, ps = layer(None, False, {}, L, family, batch)
        plain = max(pd, ph) + ps * H200.sync
        for arm, config in DROPOUT_ARMS.items():
            d, h, n, _by, syncs = layer(config, False, {}, L, family, batch)
            rows.append({"family": family, "arm": arm, "L": L, "batch": batch,
                         "plain_ms": plain * 1e3, "device_ms": d * 1e3, "host_ms": h * 1e3,
                         "syncs": syncs - ps, "launches": n - _pn,
                         "eager": (max(d, h) + syncs * H200.sync) / plain - 1})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse(ap, {})
    env = environment()
    widths = {"Llama-8B widths, L 4096": (LLAMA_8B, 4096), "base width, L 1024": ({}, 1024)}
    if args.quick:
        widths = {"base width, L 128": ({}, 128)}
    rows = []
    for name, (w, L) in widths.items():
        plain = {m: layer(None, False, w, L, micro=m) for m in {a[2] for a in ARMS.values()}}
        for arm, (config, native, micro) in ARMS.items():
            pd, ph, pn, pby, _ = plain[micro]
            d, h, n, by, _ = layer(config, native, w, L, micro=micro)
            by.subtract(pby)
            top = ", ".join(f"{op.removeprefix('aten.')} {t * 1e6:.0f} us"
                            for op, t in by.most_common(4))  # fmt: skip
            rows.append({"widths": name, "arm": arm, "plain_ms": pd * 1e3,
                         "plain_host_ms": ph * 1e3, "device_ms": d * 1e3, "host_ms": h * 1e3,
                         "launches": n - pn, "graph": d / pd - 1,
                         "eager": max(d, h) / max(pd, ph) - 1, "top": top})  # fmt: skip
            print(rows[-1], flush=True)
    from _common import command

    md = [
        "# What one protected layer adds on an H200, **modelled** (not measured)",
        "",
        f"`{command()}`; torch {env['torch']}, {env['date']}. `attnchecker.gpu_cost`: per aten "
        f"op max(bytes / {H200.bandwidth / 1e12:.1f} TB/s, FLOPs / {H200.flops / 1e12:.0f} "
        f"TFLOP/s, {H200.kernel * 1e6:.0f} us); per Triton launch max(bytes / min(bandwidth, "
        f"programs x {H200.program_rate / 1e9:.0f} GB/s), {H200.kernel * 1e6:.0f} us), a "
        f"repair on a clean step its flags' bytes; {H200.launch * 1e6:.0f} us of host time a "
        "launch in eager, none in a CUDA graph. A layer: the 2-layer trace less the 1-layer "
        "one (real tensors, nothing computed, the GPU's path), against the plain SDPA model's "
        "layer: an upper bound of a deep model's whole step (its head, embedding and "
        "optimizer are not checked by the default config). Supersedes "
        "`gpu_model_cpu2_2026-12-05.md`'s +1.7% (Llama-8B widths) and +18.9% / +14.9% (base "
        "width), withdrawn: that trace left out work (casts inside registered ops, the route's "
        "K / V expansion on CUDA), flattered the plain model (a full mask and repeated K / V "
        "under FakeTensorMode) and charged serial kernels the full bandwidth. The rows of 4 "
        "micro-batches a step (gradient accumulation) are a whole optimizer step's layer (4 "
        "forwards and backwards, their launches) against the plain one's: the weight sums run "
        "once a step.",
        "",
        "| widths | arm | plain layer ms | protected layer ms (device) | host ms | launches "
        "added | eager | CUDA graph | most device time added |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        md.append(f"| {r['widths']} | {r['arm']} | {r['plain_ms']:.2f} | {r['device_ms']:.2f} | "
                  f"{r['host_ms']:.2f} | {r['launches']} | {r['eager']:+.1%} | "
                  f"{r['graph']:+.1%} | {r['top']} |")  # fmt: skip
    drops = [] if args.quick else dropout_rows()
    if drops:
        md += [
            "",
            "## Families that train with attention dropout (issue 54, item 3)",
            "",
            f"A layer of GPT-2 and BERT at base width, L {drops[0]['L']}, B {drops[0]['batch']}, "
            "attention dropout 0.1, eager: the plain model's own CUDA kernels draw the dropout "
            "(flash; memory-efficient with a mask). On the route a dropout call's checks are the "
            "Triton family's verify kernels (dropout's bounds) and each of its two repair ops "
            f"reads its flag on the host, charged {H200.sync * 1e6:.0f} us of idle device each "
            "(a step with host reads is not capturable in a CUDA graph); on a flag the torch "
            "reference reruns the call's draw. The eager engine is where these calls went "
            "before.",
            "",
            "| family | arm | plain layer ms | protected device ms | host ms | host reads added "
            "| launches added | eager |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        md += [f"| {r['family']} | {r['arm']} | {r['plain_ms']:.2f} | {r['device_ms']:.2f} | "
               f"{r['host_ms']:.2f} | {r['syncs']} | {r['launches']} | {r['eager']:+.1%} |"
               for r in drops]  # fmt: skip
    write("gpu_layer_model", {"environment": env, "rows": rows, "dropout_rows": drops},
          "\n".join(md) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
