import torch, math
from attnchecker.adaptive.price_check import run_option, HELD_OUT
from attnchecker.adaptive.price import OPTIONS
from attnchecker.adaptive.profile import load_profiles
from attnchecker.adaptive.controller import FaultRate
D='benchmarks/results/adaptive_gpt2_small_recovery_cpu2_2026-12-05'
v,c = load_profiles(D,'gpt2')
rate = FaultRate(0.5,'step'); o = [x for x in OPTIONS if x.name=="abft_replay"][0]
for cname in ("Shakespeare", "checkpoint"):
    cond = [h for h in HELD_OUT if h.name.startswith(cname)][0]
    for s in (1, 2):
        torch.set_num_threads(2)
        _, a, la = run_option(v, c, rate, o, steps=60, seed=s, condition=cond, faults=False)
        torch.set_num_threads(1)
        _, b, lb = run_option(v, c, rate, o, steps=60, seed=s, condition=cond, faults=False)
        torch.set_num_threads(2)
        diff = sum(float((x.double()-y.double()).square().sum()) for x,y in zip(a,b)); norm = sum(float(y.double().square().sum()) for y in b)
        dev = [i+1 for i,(x,y) in enumerate(zip(la,lb)) if abs(x-y) > 1e-5*abs(y)]
        print(cname, s, "control distance %.2g" % math.sqrt(diff/norm), "first loss off by 1e-5 at", dev[:1], "max drift %.2g" % max(float((x-y).abs().max()) for x,y in zip(a,b)))
