"""What the checks add to one tensor-parallel rank's layer on an H200, **modelled** (not
measured), at Llama 3 8B and 70B widths: a TP rank's layer is a Llama layer of its shard's
widths (the hidden size whole, the query and K/V heads and the MLP's width divided by the TP
degree), since every check of a tensor-parallel layer runs on the local GEMM
(``attnchecker.attention.sharded``) and adds no communication. The same trace and device model
as ``gpu_layer_model.py`` (its ``layer``), the default config (the SDPA route, the GEMM checks'
registered Triton ops); the TP collectives themselves (the plain step's, unchanged) are left
out of both arms, so the percentage is of the rank's compute, an upper bound of its step's.

    python benchmarks/tp_shard_model.py [--quick]
"""

from __future__ import annotations

import argparse

from _common import command, environment, parse, write
from attnchecker import ABFTConfig
from attnchecker.gpu_cost import H200, LLAMA_8B
from gpu_layer_model import layer

LLAMA_70B = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "head_dim": 128}  # fmt: skip
"""Llama 3 70B's widths."""

CONFIG = ABFTConfig(backend="sdpa", check_impl="triton")


def shard(widths: dict, tp: int) -> dict:
    """The widths of one TP rank's layer (K/V heads replicated where fewer than ``tp``)."""
    return {**widths, "num_attention_heads": widths["num_attention_heads"] // tp,
            "num_key_value_heads": max(1, widths["num_key_value_heads"] // tp),
            "intermediate_size": widths["intermediate_size"] // tp}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse(ap, {})
    env = environment()
    cases = [("Llama 3 8B", LLAMA_8B, 1, 4096), ("Llama 3 8B", LLAMA_8B, 4, 4096),
             ("Llama 3 70B", LLAMA_70B, 8, 4096)]  # fmt: skip
    if args.quick:
        cases = [("base width", {"hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 128,
                                 "head_dim": 16}, 2, 128)]  # fmt: skip
    rows = []
    for name, widths, tp, L in cases:
        w = shard(widths, tp)
        pd, ph, pn, _, _ = layer(None, False, w, L)
        d, h, n, _, _ = layer(CONFIG, False, w, L)
        rows.append({"model": name, "tp": tp, "L": L, "plain_ms": pd * 1e3, "device_ms": d * 1e3,
                     "launches": n - pn, "graph": d / pd - 1,
                     "eager": max(d, h) / max(pd, ph) - 1})  # fmt: skip
        print(rows[-1], flush=True)
    md = [
        "# One tensor-parallel rank's layer on an H200, **modelled** (not measured)",
        "",
        f"`{command()}`; torch {env['torch']}, {env['date']}. The model of "
        f"`gpu_layer_model.py` ({H200.bandwidth / 1e12:.1f} TB/s, {H200.flops / 1e12:.0f} "
        "TFLOP/s, per-launch floors; what it cannot see is listed there and in docs/gpu.md) on "
        "a Llama layer of one TP rank's widths, B 1, bf16 autocast: the checks are local and "
        "add no collective; the TP collectives (the plain step's) are in neither arm.",
        "",
        "| model | TP | L | plain layer ms | protected layer ms | launches added | eager | "
        "CUDA graph |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(f"| {r['model']} | {r['tp']} | {r['L']} | {r['plain_ms']:.2f} | "
                  f"{r['device_ms']:.2f} | {r['launches']} | {r['eager']:+.1%} | "
                  f"{r['graph']:+.1%} |")  # fmt: skip
    write("tp_shard_model", {"environment": env, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
