"""The control behind ``control.md``: the fault-free twin of ``abft_replay`` trained with 2
threads and with 1 (only the reduction order, so only the rounding, differs), judged by
``validate --pricing``'s silent-deviation criterion."""

import math

from attnchecker.adaptive.controller import FaultRate
from attnchecker.adaptive.price import OPTIONS
from attnchecker.adaptive.price_check import HELD_OUT, run_option
from attnchecker.adaptive.profile import load_profiles

D = "benchmarks/results/adaptive_gpt2_small_recovery_cpu2_2026-12-05"
vuln, cost = load_profiles(D, "gpt2")
rate = FaultRate(0.5, "step")
option = next(o for o in OPTIONS if o.name == "abft_replay")
for name in ("Shakespeare", "checkpoint"):
    condition = next(h for h in HELD_OUT if h.name.startswith(name))
    for seed in (1, 2):
        runs = {}
        for threads in (2, 1):
            _, final, losses = run_option(vuln, cost, rate, option, steps=60, seed=seed,
                                          condition=condition, faults=False, threads=threads)  # fmt: skip
            runs[threads] = (final, losses)
        (a, la), (b, lb) = runs[2], runs[1]
        pairs = list(zip(a, b, strict=True))
        diff = sum(float((x.double() - y.double()).square().sum()) for x, y in pairs)
        norm = sum(float(y.double().square().sum()) for y in b)
        off = [i + 1 for i, (x, y) in enumerate(zip(la, lb, strict=True))
               if abs(x - y) > 1e-5 * abs(y)]  # fmt: skip
        drift = max(float((x - y).abs().max()) for x, y in pairs)
        print(f"{name} seed {seed}: control distance {math.sqrt(diff / norm):.2g}, first step "
              f"with the loss 1e-5 away {off[:1]}, largest drift {drift:.2g}")  # fmt: skip
