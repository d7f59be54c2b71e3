"""protect_ on a model of one's own (a nanoGPT-style GPT written here, attention by
``F.scaled_dot_product_attention`` on a fused ``c_attn``) against a Hugging Face GPT-2 of the
same width, depth, heads, vocabulary and batch (its dropouts off: the GPT has none, and a
dropout's time in the baseline would shrink the relative overhead): is there a cost for being
generic?

Four models per row, stepped alternately in one process (forward, backward, AdamW): each of
the two plain (SDPA) and protected with the default config (the GPT with ``example=``, so its
projections are found and checked as GPT-2's are). Overhead = median of per-pair time ratios
minus 1, for each model against its own plain self; the difference of the two overheads is
what being generic costs.

Also the one-time cost of finding the projections at the first forward (``protect_(model)``
without ``example=``): for ``--fresh`` fresh copies of the GPT, the first protected step (the
traced forward, the wiring, then the checked step) against the median of its next steps; and
the plain step for scale.

    python benchmarks/own_model.py [--lengths 128] [--width 256] [--reps 12] [--fresh 5] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from _common import alternate, environment, median_ms, parse, timed, write
from attnchecker import protect_
from attnchecker.models.sdpa import sdpa_modules
from attnchecker.models.tiny import build


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _stepper(run, idx: torch.Tensor, params) -> callable:
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step() -> None:
        logits = run(idx)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)) - 1


def measure(L: int) -> dict:
    d, heads, layers, vocab = ARGS.width, ARGS.heads, ARGS.layers, ARGS.vocab
    B = max(1, 8 * 128 // L)
    idx = torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    own = GPT(vocab, L, d, heads, layers).train()
    own_p = copy.deepcopy(own)
    protect_(own_p, example=(idx[:1],))
    names = {id(m): n for n, m in own.named_modules()}
    found = sorted(
        f"{names[id(p.module)]}: {','.join(p.sites)}"
        for specs in sdpa_modules(own, (idx[:1],)).projections.values()
        for p in specs
    )
    hf = build("gpt2", "tiny", n_embd=d, n_head=heads, n_layer=layers, vocab_size=vocab,
               n_positions=L, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    hf.config.use_cache = False
    hf.train()
    hf.set_attn_implementation("sdpa")
    hf_p = copy.deepcopy(hf)
    protect_(hf_p)
    steps = {
        "own": _stepper(own, idx, own.parameters()),
        "own_protected": _stepper(own_p, idx, own_p.parameters()),
        "hf": _stepper(lambda i: hf(input_ids=i).logits, idx, hf.parameters()),
        "hf_protected": _stepper(lambda i: hf_p(input_ids=i).logits, idx, hf_p.parameters()),
    }
    times = alternate(steps, ARGS.reps)
    own_over, hf_over = _ratio(times, "own_protected", "own"), _ratio(times, "hf_protected", "hf")
    pairs = [
        (a / b) - (c / e)
        for a, b, c, e in zip(times["own_protected"], times["own"], times["hf_protected"],
                              times["hf"], strict=True)
    ]  # fmt: skip
    return {
        "L": L, "batch": B, "found": found,
        **{f"{k}_ms": median_ms(v) for k, v in times.items()},
        "own_overhead": own_over, "hf_overhead": hf_over,
        "generic_minus_hf": statistics.median(pairs),
    }  # fmt: skip


def first_forward(L: int) -> dict:
    """The first protected step without example= (discovery included) against the first step
    of the same GPT protected with example= (whose protect_ call, timed apart, did the same
    trace), over ``--fresh`` fresh GPTs; the later steps and the plain step for scale."""
    d, heads, layers, vocab = ARGS.width, ARGS.heads, ARGS.layers, ARGS.vocab
    B = max(1, 8 * 128 // L)
    idx = torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(0))
    out: dict[str, list[float]] = {k: [] for k in ("first", "first_example", "protect_example",
                                                   "later", "plain")}  # fmt: skip
    for i in range(ARGS.fresh):
        torch.manual_seed(i)
        own = GPT(vocab, L, d, heads, layers).train()
        bare, ex = copy.deepcopy(own), copy.deepcopy(own)
        handle = protect_(own)
        t = time.perf_counter()
        protect_(ex, example=(idx,))
        out["protect_example"].append(time.perf_counter() - t)
        steps = {"first": _stepper(own, idx, own.parameters()),
                 "first_example": _stepper(ex, idx, ex.parameters())}  # fmt: skip
        for k in ("first_example", "first") if i % 2 else ("first", "first_example"):
            out[k].append(timed(steps[k]))
        assert not handle.pending and all(
            not c["unchecked"] for c in handle.summary()["per_module"].values()
        ), handle.summary()["per_module"]
        times = alternate({"later": steps["first"], "plain": _stepper(bare, idx,
                                                                      bare.parameters())},
                          ARGS.reps)  # fmt: skip
        out["later"].append(statistics.median(times["later"]))
        out["plain"].append(statistics.median(times["plain"]))
    extra = [f - e for f, e in zip(out["first"], out["first_example"], strict=True)]
    return {
        "L": L, "batch": B, "fresh": ARGS.fresh,
        **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in out.items()},
        "extra_ms": 1e3 * statistics.median(extra),
        "extra_in_plain_steps": statistics.median(
            e / p for e, p in zip(extra, out["plain"], strict=True)
        ),
    }  # fmt: skip


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _markdown(rows: list[dict], firsts: list[dict], env: dict) -> str:
    lines = [
        "# protect_ on a model of one's own vs a Hugging Face model of the same width",
        "",
        f"A nanoGPT-style GPT (SDPA on a fused c_attn) and transformers' GPT-2 (SDPA, its "
        f"dropouts 0 as the GPT has none), both hidden {ARGS.width}, {ARGS.heads} heads, {ARGS.layers} layers, vocabulary "
        f"{ARGS.vocab}, batch 8 at L = 128 (8 * 128 / L beyond), train mode, AdamW; each "
        f"protected with the default config (the GPT with `example=`: projections found and "
        f"checked). Four models stepped alternately in one process, {ARGS.reps} rounds; "
        f"overhead = median of per-pair ratios - 1 against the same model plain; torch "
        f"{env['torch']}, {env['threads']} threads, {env['date']}.",
        "",
        "| L | own plain ms | own protected | GPT-2 plain ms | GPT-2 protected | own - GPT-2 "
        "(median of paired differences) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['L']} | {r['own_ms']:.1f} | {_pct(r['own_overhead'])} | {r['hf_ms']:.1f} | "
            f"{_pct(r['hf_overhead'])} | {100 * r['generic_minus_hf']:+.1f} points |"
            for r in rows
        ),
        "",
        f"Projections found in the GPT: {', '.join(rows[0]['found']) if rows else ''}.",
        "",
        "## The first forward without example=",
        "",
        f"`protect_(gpt)` with no example: the first step traces one forward (gradients on), "
        f"wires protection and runs the checked step. Against a copy protected with "
        f"`example=` (its protect_ call, timed apart, did the same trace): the two first steps "
        f"in alternating order; medians over {ARGS.fresh} fresh GPTs; the later steps (median "
        f"of {ARGS.reps}, alternated with the plain GPT's) for scale.",
        "",
        "| L | first step, no example ms | first step, example= ms | protect_ with example= "
        "ms | later protected steps ms | plain step ms | discovery at the first forward ms "
        "| in plain steps |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {f['L']} | {f['first_ms']:.1f} | {f['first_example_ms']:.1f} | "
            f"{f['protect_example_ms']:.1f} | {f['later_ms']:.1f} | {f['plain_ms']:.1f} | "
            f"{f['extra_ms']:.1f} | {f['extra_in_plain_steps']:.2f} |"
            for f in firsts
        ),
    ]
    return "\n".join(lines) + "\n"


ARGS = argparse.Namespace()


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--fresh", type=int, default=5, help="fresh models for the first forward")
    ARGS = parse(ap, quick={"lengths": [32], "width": 32, "reps": 2, "vocab": 64, "fresh": 2})
    env = environment()
    rows, firsts = [], []
    for L in ARGS.lengths:
        rows.append(measure(L))
        r = rows[-1]
        print(f"L={L}: own {_pct(r['own_overhead'])}, GPT-2 {_pct(r['hf_overhead'])}, "
              f"difference {100 * r['generic_minus_hf']:+.1f} points")  # fmt: skip
        firsts.append(first_forward(L))
        f = firsts[-1]
        print(f"L={L}: first step {f['first_ms']:.1f} ms (with example= {f['first_example_ms']:.1f}"
              f" ms), plain {f['plain_ms']:.1f} ms: discovery {f['extra_ms']:.1f} ms once")  # fmt: skip
    write("own_model", {"env": env, "args": vars(ARGS), "rows": rows, "first_forward": firsts},
          _markdown(rows, firsts, env))  # fmt: skip


if __name__ == "__main__":
    main()
