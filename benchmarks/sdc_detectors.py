"""Detectors side by side on the same simulated SDC: detection rate, latency, false alarms, cost.

Each trial trains a tiny model for 12 steps under the study-shaped SDC preset from step 4 on
(faults inside attention at the named sites and at the MLP outputs), watched by four detectors
(see ``attnchecker.sdc.detectors``), and once without faults for false alarms. Costs are measured
on the same model: the loss check is one host sync per step; step replay one more forward and
backward; the replica check a parameter comparison every 4 steps (plus a replica, which data
parallelism usually has anyway); ABFT the protected step's overhead.

    python benchmarks/sdc_detectors.py [--trials 5] [--families llama gpt2]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from _common import alternate, environment, write
from attnchecker import protect_
from attnchecker.models.tiny import build
from attnchecker.sdc.detectors import DETECTORS, DetectorTrial, run_detectors


def costs(family: str) -> dict[str, float]:
    plain = build(family)
    plain.train()
    prot = copy.deepcopy(plain)
    protect_(prot)
    ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))

    def step(m):
        def f() -> None:
            m(input_ids=ids, labels=ids).loss.backward()
            m.zero_grad(set_to_none=True)

        return f

    twin = copy.deepcopy(plain)
    t = alternate(
        {
            "plain": step(plain),
            "abft": step(prot),
            "compare": lambda: all(
                torch.equal(p, q)
                for p, q in zip(plain.parameters(), twin.parameters(), strict=True)
            ),
        },
        20,
    )
    base = statistics.median(t["plain"])
    return {
        "loss_check": 0.0,
        "step_replay": 1.0,
        "replica_check": statistics.median(t["compare"]) / base / 4,
        "abft": statistics.median(p / q for p, q in zip(t["abft"], t["plain"], strict=True)) - 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=["llama", "gpt2"])
    args = ap.parse_args()
    env = environment()
    rows = []
    for fam in args.families:
        results = [run_detectors(DetectorTrial(family=fam, seed=s)) for s in range(args.trials)]
        cost = costs(fam)
        for d in DETECTORS:
            hits = [r[d] for r in results]
            lat = [h["latency_steps"] for h in hits if h["detected"]]
            rows.append({
                "family": fam, "detector": d, "trials": len(hits),
                "detection_rate": sum(h["detected"] for h in hits) / len(hits),
                "mean_latency_steps": statistics.mean(lat) if lat else None,
                "false_alarms": sum(h["false_alarm"] for h in hits), "overhead": cost[d],
            })  # fmt: skip
            r = rows[-1]
            print(
                f"{fam:6s} {d:14s} detected {r['detection_rate']:.0%} latency {r['mean_latency_steps']} false alarms {r['false_alarms']} overhead {100 * r['overhead']:.1f}%"
            )
    lines = [
        "# SDC detectors side by side",
        "",
        f"`python benchmarks/sdc_detectors.py --trials {args.trials}`; torch {env['torch']}, {env['date']}. Tiny models, "
        "12 steps, study-shaped SDC preset (per element 1e-3 in attention at q/k/v/scores/probs/context/out, 3e-4 at MLP "
        "outputs, relative errors 1e-8..1e-2 with a 1% tail to 1e3) from step 4; latency in steps from the onset; false "
        "alarms on the same runs without faults. Overhead: extra time per step (replica check: parameter comparison every "
        "4 steps, not counting the replica itself; ABFT: protected step vs plain at this tiny width, hidden 32, where its "
        "fixed per-op cost dominates: at base width the step overhead is 0-8%, see protect_overhead). The replica check "
        "runs at steps 4, 8, 12, so its latency is 0 here by alignment with the onset; it is up to k - 1 in general. ABFT "
        "sees the faults inside attention only (MLP faults are not checked).",
        "",
        "| family | detector | trials | detection rate | mean latency (steps) | false alarms | overhead |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lat = "-" if r["mean_latency_steps"] is None else f"{r['mean_latency_steps']:.1f}"
        lines.append(
            f"| {r['family']} | {r['detector']} | {r['trials']} | {r['detection_rate']:.0%} | {lat} | {r['false_alarms']} | {100 * r['overhead']:.1f}% |"
        )
    write("sdc_detectors", {"environment": env, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
