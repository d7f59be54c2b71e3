"""Single bit flips in GEMM outputs: which move the step's gradient, and which pass unseen.

Production's silent corruptions are mostly small (``../shared/spec/detection-power.md`` sec. 3):
a check of extreme values sees the few flips that matter most and misses the rest. Per trial,
one bit drawn uniformly over the width of one element (16 bits of a bf16 output, 32 of an fp32
one) of one site's output, drawn uniformly over the sites of layer 0 (the projections' outputs,
the eager core's scores / probabilities / context, and the backward's dX / dW and core
gradients), flipped in one training step of a protected model; the step's gradient (after the
checks' repairs) is compared with the same step without the flip (the same site hooked: a hook
may move the step onto another path, :func:`_reference`). Classified by the relative
change of the whole gradient (``||g - g_clean|| / ||g_clean||``: below 1e-3 masked, 1e-3 .. 1e-2
small, above 1e-2 matters) and by what ``drain()`` said (corrected / recomputed, uncorrectable,
nothing: silent).

    python benchmarks/bit_flips.py [--trials 400] [--size small] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

if "--check-impl" in sys.argv and not torch.cuda.is_available():  # the registered ops run in
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's interpreter (set before import)

from _common import command, environment, impl_tag, impl_words, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.models.tiny import build
from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

SEQ_LEN, BATCH = 64, 4
INT = {2: torch.int16, 4: torch.int32}


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None])


def _step(model, ids) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    return _grads(model)


def _reference(handle, model, ids, site: str, refs: dict) -> torch.Tensor:
    """The step's gradient with a hook on ``site`` that changes nothing: a site's hook may move
    the step onto another path (on the SDPA route, a hook on the scores or probabilities runs
    the eager core, which rounds differently from the backend's kernel), so a flip is measured
    against the same path without it."""
    if site not in refs:
        det = handle.attach(lambda call: None, sites=[site])
        refs[site] = _step(model, ids)
        det.remove()
        assert not handle.drain(), f"a false alarm on the clean step with a hook on {site}"
    return refs[site]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--size", default="small", help="tiny (head dim 8), small (64), base (64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-impl", default="auto", help="ABFTConfig.check_impl (accumulator: "
                    "the projections on the accumulator GEMM)")  # fmt: skip
    ap.add_argument("--backend", default="auto", help="ABFTConfig.backend (sdpa: the CUDA "
                    "default's route, its checks by their torch references on a CPU)")  # fmt: skip
    ap.add_argument("--sampled-rows", type=int, default=0, help="ABFTConfig.sampled_rows (the "
                    "route's sampled per-element check of the core)")  # fmt: skip
    args = parse(ap, quick={"trials": 6, "size": "tiny"})
    t0 = time.perf_counter()
    corpus = load_corpus()
    blocks = TokenBlocks.build(corpus, tokenizer_for(corpus, 512), SEQ_LEN)
    model = build(args.family, args.size, vocab_size=blocks.vocab_size, max_len=SEQ_LEN,
                  seed=args.seed, num_hidden_layers=1)  # fmt: skip
    model.train()
    config = ABFTConfig(policy="warn", check_impl=args.check_impl, backend=args.backend,
                        sampled_rows=args.sampled_rows)  # fmt: skip
    handle = protect_(model, config)
    ids, _ = blocks.batch(0, BATCH, args.seed)
    _step(model, ids)
    assert not handle.drain(), "a false alarm on the clean step"
    sites = sorted({s for st in handle._states.values() for s in st.hooks})
    g = torch.Generator().manual_seed(args.seed)
    rows, refs = [], {}
    for trial in range(args.trials):
        if trial and trial % 25 == 0:
            print(f"[{trial}/{args.trials} {time.perf_counter() - t0:.0f} s]", flush=True)
        site = sites[int(torch.randint(0, len(sites), (), generator=g))]
        hit: dict = {}

        def flip(call, site=site, hit=hit):
            if hit or call.layer != 0 or call.replay:
                return
            t = call.tensor
            bits = INT.get(t.element_size())
            if bits is None or not t.is_contiguous():
                return
            flat = t.view(-1).view(bits)  # the element's bits (a contiguous site tensor)
            i = int(torch.randint(0, flat.numel(), (), generator=g))
            b = int(torch.randint(0, 8 * t.element_size(), (), generator=g))
            mask = torch.tensor(1 << b if b < 8 * t.element_size() - 1 else -(1 << b), dtype=bits)
            hit.update(bit=b, dtype=str(t.dtype).removeprefix("torch."),
                       before=float(t.view(-1)[i]))  # fmt: skip
            flat[i] ^= mask
            hit["after"] = float(t.view(-1)[i])

        det = handle.attach(flip, sites=[site])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            grads = _step(model, ids)
            events = handle.drain()
        det.remove()
        if not hit:  # the site did not run in layer 0 this step (or not contiguous)
            continue
        ref = _reference(handle, model, ids, site, refs)
        rel = float((grads - ref).norm() / ref.norm())
        if rel != rel:  # NaN
            rel = float("inf")
        actions = sorted({e.action for e in events})
        outcome = "silent" if not events else (
            "uncorrectable" if "uncorrectable" in actions else "corrected")  # fmt: skip
        rows.append({"site": site, **hit, "rel": rel, "outcome": outcome, "actions": actions})
    env = environment()
    route_words = impl_words(args.check_impl)
    if args.backend == "sdpa":
        route_words = ("the SDPA route, the CUDA default's checks (their torch references on a "
                       "CPU)" + (f", {args.sampled_rows} sampled rows a head and call"
                                 if args.sampled_rows else ""))  # fmt: skip

    def cls(r):
        return "masked" if r["rel"] < 1e-3 else "small" if r["rel"] < 1e-2 else "matters"

    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        counts[cls(r), r["outcome"]] = counts.get((cls(r), r["outcome"]), 0) + 1
    moved = [r for r in rows if r["rel"] >= 1e-3]
    unseen = [r for r in moved if r["outcome"] == "silent"]
    big_unseen = [r for r in unseen if r["rel"] >= 1e-2]
    lines = [
        "# Single bit flips in GEMM outputs: effect on the step's gradient and what was seen",
        "",
        f"`{command()}`; {env['date']}, torch {env['torch']}, {time.perf_counter() - t0:.0f} s. "
        f"{args.family} ({args.size}, 1 layer), bf16 autocast, L {SEQ_LEN}, batch {BATCH}, "
        f"`ABFTConfig(policy='warn', check_impl={args.check_impl!r}, backend="
        f"{args.backend!r}, sampled_rows={args.sampled_rows})` ({route_words}); one bit "
        "uniform over "
        f"the element's width at a uniform element of a uniform site of layer 0 "
        f"({len(sites)} sites), one step; {len(rows)} trials with a flip.",
        "",
        f"**Flips that moved the gradient by >= 0.1% and passed unseen: {len(unseen)} of "
        f"{len(moved)}; above 1%: {len(big_unseen)}.**",
        "",
        "| effect on the gradient | corrected | uncorrectable | silent |",
        "|---|---:|---:|---:|",
    ]
    for c in ("masked", "small", "matters"):
        lines.append(f"| {c} | {counts.get((c, 'corrected'), 0)} | "
                     f"{counts.get((c, 'uncorrectable'), 0)} | {counts.get((c, 'silent'), 0)} |")  # fmt: skip
    if unseen:
        lines += ["", "Unseen flips that moved the gradient (site, dtype, bit, value before -> "
                  "after, relative change):", ""]  # fmt: skip
        for r in sorted(unseen, key=lambda r: -r["rel"])[:20]:
            lines.append(f"- {r['site']} {r['dtype']} bit {r['bit']}: {r['before']:.4g} -> "
                         f"{r['after']:.4g}, {r['rel']:.2e}")  # fmt: skip
    print("\n".join(lines))
    tag = impl_tag(args.check_impl) + ("_sdpa" if args.backend == "sdpa" else "")
    tag += f"_s{args.sampled_rows}" if args.sampled_rows else ""
    write(f"bit_flips_{args.size}{tag}", {"environment": env, "rows": rows},
          "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
