"""Shared by the protected-attention tests: tiny models, a batch, one training step."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from attnchecker.inject import exponent_flip
from attnchecker.models.tiny import build

SITES = ("q", "k", "v", "scores", "probs", "context", "out")
KINDS = {
    "inf": lambda x: torch.full_like(x, float("inf")),
    "-inf": lambda x: torch.full_like(x, float("-inf")),
    "nan": lambda x: torch.full_like(x, float("nan")),
    "1e10": lambda x: torch.full_like(x, 1e10),
    "exp_flip": exponent_flip,
    "random_large": lambda x: (
        x + torch.empty_like(x).uniform_(1e4, 1e8, generator=torch.Generator().manual_seed(7))
    ),
}
PATTERNS = ("0D", "1R", "1C", "2D")


def pattern_index(t: Tensor, pattern: str) -> tuple:
    """Where a pattern lands in a site tensor: projections (B, L, N) are the flattened GEMM
    (B * L tokens by N features); attention tensors (B, H, L, M) are per-head matrices; the
    backward's dX (T, K) and dW (N, K) are matrices."""
    if t.dim() == 2:
        return {
            "0D": (5, 3),
            "1R": (5, slice(None)),
            "1C": (slice(None), 7),
            "2D": (slice(2, 5), slice(4, 9)),
        }[pattern]
    if t.dim() == 3:
        return {
            "0D": (1, 5, 3),
            "1R": (1, 5, slice(None)),
            "1C": (slice(None), slice(None), 7),
            "2D": (1, slice(2, 5), slice(4, 9)),
        }[pattern]
    return {
        "0D": (1, 2, 5, 3),
        "1R": (1, 2, 5, slice(None)),
        "1C": (0, 1, slice(None), 4),
        "2D": (1, 3, slice(2, 5), slice(3, 7)),
    }[pattern]


def batch(family: str, B: int = 2, L: int = 16, seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, L - 4 :] = 0  # padding in the second sample
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def attention_layers(model: nn.Module) -> list[int]:
    """The layer index of every attention module of a tiny model, in module order: one per
    layer; a sequence-to-sequence model's encoder layers, then self- and cross-attention of
    each decoder layer."""
    c = model.config
    if c.is_encoder_decoder:
        dec = [i for i in range(c.decoder_layers) for _ in (0, 1)]
        return list(range(c.encoder_layers)) + dec
    return list(range(c.num_hidden_layers))


def train_step(model: nn.Module, inputs: dict[str, Tensor], *, lr: float = 1e-3):
    """One AdamW step from fresh optimizer state: (loss, grads, params after the step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(1234)  # same dropout masks in every arm
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, params


def models(family: str, *, dropout: bool = True, **kw) -> tuple[nn.Module, nn.Module]:
    """A tiny ``family`` model in training mode, twice; ``dropout=False``: every dropout
    probability of its config 0."""
    if not dropout:
        from attnchecker.models.tiny import no_dropout

        kw |= no_dropout(family, kw.get("size", "tiny"))
    m = build(family, **kw)
    m.train()
    return m, copy.deepcopy(m)


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def update_excess(got, want, *, lr: float = 1e-3, eps: float = 1e-8) -> float:
    """How far the parameters after :func:`train_step` (fresh AdamW) differ beyond what AdamW
    itself makes of the two runs' gradient difference (compared on its own, to ``atol``).

    AdamW's first step moves each parameter by lr g / (|g| + eps) (plus the same weight decay in
    both runs): with gradients g, g' its difference is at most lr eps |g - g'| / (eps + m)^2,
    m = min(|g|, |g'|) when they share a sign, else 0. Near |g| ~ eps that amplifies a last-bit
    gradient difference (a recomputed row) by up to 1 / eps, which is not an error of the
    repair: only the excess over this envelope counts."""
    worst = 0.0
    for k in want[2]:
        g, g2 = want[1][k], got[1][k]
        same = torch.sign(g) == torch.sign(g2)
        m = torch.where(same, torch.minimum(g.abs(), g2.abs()), 0.0)
        envelope = lr * eps * (g - g2).abs() / (eps + m) ** 2
        worst = max(worst, float(((got[2][k] - want[2][k]).abs() - envelope).max()))
    return worst


def fire_once(site: str, pattern: str, kind: str, *, layer: int | None = 0, module=None, when=None):
    """A site hook that puts one fault (kind x pattern) at ``site`` of the given layer (or
    module), once, never in a checkpointing replay; ``when(call)`` can restrict it further."""
    fired: list[tuple[int, ...]] = []

    def hook(call):
        if call.site != site or call.replay or fired:
            return
        if (layer is not None and call.layer != layer) or (
            module is not None and call.module != module
        ):
            return
        if when is not None and not when(call):
            return
        idx = pattern_index(call.tensor, pattern)
        call.tensor[idx] = KINDS[kind](call.tensor[idx].clone())
        fired.append(tuple(call.tensor.shape))

    hook.fired = fired
    return hook


def fault_list(sites=SITES, kinds=KINDS, patterns=PATTERNS, rotate=None) -> list[tuple]:
    """The (site, kind, pattern) faults of :func:`fault_matrix`."""
    kinds = list(kinds)
    if rotate is None:
        return [(s, k, p) for s in sites for k in kinds for p in patterns]
    pairs = [(s, p) for s in sites for p in patterns]
    return [(s, kinds[(i + rotate) % len(kinds)], p) for i, (s, p) in enumerate(pairs)]


def fault_matrix(
    base,
    inputs,
    step,
    *,
    config=None,
    sites=SITES,
    kinds=KINDS,
    patterns=PATTERNS,
    layer=0,
    module=None,
    rtol=1e-6,
    atol=1e-5,
    rotate=None,
    reported=None,
):
    """Run ``step(model, inputs) -> (loss, grads, params)`` on a protected copy of ``base`` once
    per fault and compare with the fault-free step; return the failures (empty when every fault
    was corrected, reported as such, and left the loss, every gradient and the update equal).

    The faults: every (site, kind, pattern), or with ``rotate`` (an int) every (site, pattern)
    once, the kinds taking turns from the ``rotate``-th on: calls with ``rotate`` 0, 1, ...
    len(kinds) - 1 together run every triple. ``reported``: the checks whose event may report a
    fault at a site (site -> ops; the site's own op by default)."""
    from attnchecker import ABFTConfig, protect_

    want = step(copy.deepcopy(base), inputs)
    failures = []
    for site, kind, pattern in fault_list(sites, kinds, patterns, rotate):
        model = copy.deepcopy(base)
        handle = protect_(model, config or ABFTConfig())
        hook = fire_once(site, pattern, kind, layer=layer, module=module)
        handle.attach(hook)
        got = step(model, inputs)
        events = handle.drain()
        ok = (
            bool(hook.fired)
            and torch.allclose(got[0], want[0], rtol=rtol, atol=0)
            and max_diff(got[1], want[1]) <= atol
            and update_excess(got, want) <= atol
            and any(
                e.op in ((reported or {}).get(site) or (site,))
                and e.action in ("corrected", "recomputed")
                for e in events
            )
            and not any(e.action == "uncorrectable" for e in events)
        )
        if not ok:
            diffs = (max_diff(got[1], want[1]), update_excess(got, want))
            failures.append((site, kind, pattern, float(got[0]), diffs,
                             [(e.op, e.action) for e in events]))  # fmt: skip
    return failures


def bf16_q_row_fault(faulty: nn.Module, ref: nn.Module, inputs: dict[str, Tensor], device: str):
    """A NaN token row in Q of layer 1 under bf16 autocast: (protected faulty step, fault-free
    step, the faulty model's events); a corrected step matches to bf16 precision."""
    from attnchecker import protect_

    h = protect_(faulty)
    h.attach(fire_once("q", "1R", "nan", layer=1))  # the first module of layer 1 (BART has 3)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = train_step(faulty, inputs)
        want = train_step(ref, inputs)
    return got, want, h.drain()


def sync_counts(model, inputs) -> dict[str, int]:
    """Host-synchronising aten ops of one forward + backward (attnchecker.testing), after one
    uncounted step (one-off setup, such as cached index constants, is not counted). The
    uncounted step runs under the counter too: under a dispatch mode the check regions run as
    eager ops, whose cached constants a step of compiled regions (CUDA) would not have made."""
    from attnchecker.testing import count_ops

    count_ops(lambda: model(**inputs).loss.backward())
    return count_ops(lambda: model(**inputs).loss.backward()).syncs


def added_syncs(protected, plain, inputs) -> dict[str, int]:
    """The host-synchronising ops a protected step runs more often than the plain model's
    (empty when protection adds none; it may run fewer: GPT-Neo's own attention builds a
    tensor from host data per layer, which the checked attention replaces)."""
    mine, theirs = sync_counts(protected, inputs), sync_counts(plain, inputs)
    return {op: n - theirs.get(op, 0) for op, n in mine.items() if n > theirs.get(op, 0)}


def step_and_drain(run, opt, handle, detach=None) -> list:
    """One training step of ``run()`` (returns the loss) from seed 0, the hook ``detach`` (an
    attached fault) removed after it, and the events drained with warnings silenced."""
    import warnings

    torch.manual_seed(0)
    run().backward()
    opt.step()
    opt.zero_grad()
    if detach is not None:
        detach.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return handle.drain()


def lm_step(model: nn.Module, idx: Tensor, run=None) -> tuple[Tensor, list[Tensor]]:
    """One next-token step of a model mapping ids (B, T) to logits (B, T, V), run through
    ``run`` (a compiled model) when given: the loss and every parameter's gradient."""
    model.zero_grad()
    logits = (model if run is None else run)(idx)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)
    )
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
