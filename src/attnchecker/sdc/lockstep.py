"""A healthy and a faulty replica in lockstep, at the three levels of the SDC study (one process).

The replicas start from identical state (same weights, data, RNG per step) and differ only by an
:class:`~attnchecker.sdc.faults.SDCModel` on the faulty side:

1. **submodule**: the healthy replica runs first and keeps every attention and MLP output (and
   the gradient flowing back into each); the faulty one compares each of its own tensors with
   the healthy one (mismatch frequency and severity per layer, submodule, direction, step) and
   then overwrites it with the healthy tensor, so an error never reaches the next submodule;
2. **step**: no overwrites inside the step; the gradient noise-to-signal ratio
   ||g_f - g_h|| / ||g_h|| and cosine per step, then parameters and optimizer state are copied
   from healthy to faulty (the study does not say what it did with optimizer state: we copy it);
3. **period**: no synchronisation; loss curves, parameter drift (global, per layer), loss spikes
   and the share of held-out predictions that differ, beside a healthy control run with another
   data seed that calibrates ordinary run-to-run divergence.

Every experiment is gated on a healthy-vs-healthy run of level 1 with mismatch frequency exactly
0 (bitwise determinism); if the backend is not deterministic the summary says so and mismatches
are counted beyond ``tolerance`` (relative) instead.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnchecker.errors import ConfigError
from attnchecker.sdc.faults import STUDY_NODE, SDCModel

__all__ = [
    "LockstepConfig",
    "Replica",
    "batch_inputs",
    "boundaries",
    "corrupting",
    "mismatch",
    "mismatch_row",
    "output_tensor",
    "prediction_divergence",
    "run_lockstep",
    "set_determinism",
    "setup_run",
    "token_batches",
]


def set_determinism(seed: int) -> None:
    """Seed everything and ask torch for deterministic kernels (bitwise repeatable on CPU)."""
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def boundaries(model: nn.Module) -> list[tuple[str, int, str, nn.Module]]:
    """(name, layer, "attention" | "mlp", module) for every transformer block of ``model``: its
    attention and MLP submodules as the family table names them
    (:func:`attnchecker.models.registry.transformer_blocks`)."""
    from attnchecker.models.registry import transformer_blocks

    out = []
    for b in transformer_blocks(model):
        out += [
            (f"{b.name}.attn", b.layer, "attention", b.attention),
            (f"{b.name}.mlp", b.layer, "mlp", b.mlp),
        ]
    if not out:
        raise ConfigError("found no transformer blocks with an attention and an MLP submodule")
    return out


def output_tensor(output: object) -> Tensor | None:
    """The tensor a submodule's output holds: itself, or the first element of a tuple / list."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


@dataclass(frozen=True, kw_only=True)
class LockstepConfig:
    level: int = 1
    family: str = "llama"
    size: str = "tiny"
    steps: int = 20
    batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    seed: int = 0
    control_seed: int = 1
    data: tuple[str, ...] | None = None
    gate_steps: int = 2
    tolerance: float = 1e-6  # relative, used only if the healthy-vs-healthy gate is not exact
    sdc: SDCModel = STUDY_NODE

    def __post_init__(self) -> None:
        if self.level not in (1, 2, 3):
            raise ConfigError(f"level must be 1, 2 or 3, got {self.level}")


class Replica:
    """A model, its optimizer and its boundary hooks."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.sites = boundaries(model)

    def step(self, inputs: dict[str, Tensor], rng: int, hook=None) -> float:
        handles = (
            [
                m.register_forward_hook(hook(name, layer, kind))
                for name, layer, kind, m in self.sites
            ]
            if hook
            else []
        )
        try:
            torch.manual_seed(rng)  # identical dropout in both replicas
            loss = self.model(**inputs).loss
            loss.backward()
        finally:
            for h in handles:
                h.remove()
        return loss.item()

    def grads(self) -> Tensor:
        return torch.cat(
            [p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None]
        )

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def mismatch(faulty: Tensor, healthy: Tensor, tol: float = 0.0) -> tuple[int, float]:
    """Elements that differ (bitwise, or beyond the stated tolerance; NaN-aware) and their mean
    relative difference."""
    f, h = faulty.detach().float(), healthy.float()
    same = (f - h).abs() <= tol * h.abs() if tol else f == h
    differ = ~(same | (f.isnan() & h.isnan()))
    n = int(differ.sum())
    if n == 0:
        return 0, 0.0
    # |h| is floored at 1e-6 of the tensor's largest |h|: exact zeros (masked positions, zero
    # gradients) would otherwise make the mean relative difference infinite.
    floor = 1e-6 * float(h.abs().nan_to_num(0.0, 0.0, 0.0).max().clamp_min(1e-30))
    rel = ((f - h).abs() / h.abs().clamp_min(floor))[differ]
    return n, float(rel.nan_to_num(float("inf")).mean())


def mismatch_row(
    step: int, name: str, layer: int, kind: str, direction: str, elements: int, n: int, sev: float
) -> dict:
    return {"step": step, "module": name, "layer": layer, "submodule": kind, "direction": direction,
            "elements": elements, "mismatches": n, "severity": sev}  # fmt: skip


def _level1_step(
    healthy: Replica,
    faulty: Replica,
    inputs: dict[str, Tensor],
    rng: int,
    sdc: SDCModel | None,
    step: int,
    gen: torch.Generator,
    tol: float = 0.0,
) -> tuple[float, float, list[dict[str, Any]]]:
    kept: dict[str, Tensor] = {}
    kept_grad: dict[str, Tensor] = {}
    rows: list[dict[str, Any]] = []

    def keep(name, layer, kind):
        def hook(module, args, output):
            t = output_tensor(output)
            if t is not None:
                kept[name] = t.detach().clone()
                if t.requires_grad:
                    t.register_hook(
                        lambda g, name=name: kept_grad.__setitem__(name, g.detach().clone())
                    )

        return hook

    def check(name, layer, kind):
        rate = (sdc.rate if kind == "attention" else sdc.mlp_rate) if sdc is not None else 0.0
        on = sdc is not None and sdc.active(step)

        def hook(module, args, output):
            t = output_tensor(output)
            if t is None:
                return
            if on and sdc.forward:
                sdc.corrupt_(t.data, site_rate=rate, generator=gen)
            n, sev = mismatch(t, kept[name], tol)
            rows.append(mismatch_row(step, name, layer, kind, "forward", t.numel(), n, sev))
            t.data.copy_(kept[name])
            if t.requires_grad:

                def on_grad(g: Tensor) -> Tensor:
                    g = g.clone()
                    if on and sdc.backward:
                        sdc.corrupt_(g, site_rate=rate, generator=gen)
                    n, sev = mismatch(g, kept_grad[name], tol)
                    rows.append(
                        mismatch_row(step, name, layer, kind, "backward", g.numel(), n, sev)
                    )
                    return kept_grad[name]

                t.register_hook(on_grad)

        return hook

    loss_h = healthy.step(inputs, rng, keep)
    loss_f = faulty.step(inputs, rng, check)
    return loss_h, loss_f, rows


def token_batches(cfg: LockstepConfig):
    from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

    corpus = load_corpus(list(cfg.data) if cfg.data else None)
    return TokenBlocks.build(corpus, tokenizer_for(corpus, 2048), cfg.seq_len)


def batch_inputs(blocks, step: int, cfg: LockstepConfig, seed: int) -> dict[str, Tensor]:
    x, _ = blocks.batch(step, cfg.batch, seed)
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


def setup_run(cfg: LockstepConfig) -> tuple[Any, torch.nn.Module, torch.Generator]:
    """Deterministic kernels, the batches, the base model both runs copy, the fault generator."""
    from attnchecker.models.tiny import build

    set_determinism(cfg.seed)
    blocks = token_batches(cfg)
    base = build(
        cfg.family, cfg.size, seed=cfg.seed, vocab_size=blocks.vocab_size, max_len=cfg.seq_len
    )
    base.config.use_cache = False
    base.train()
    return blocks, base, torch.Generator().manual_seed(cfg.sdc.seed)


def run_lockstep(cfg: LockstepConfig, out: str | Path) -> dict[str, Any]:
    """Run the determinism gate and the chosen level; write ``steps.jsonl`` and ``summary.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    blocks, base, gen = setup_run(cfg)

    # The gate: two healthy replicas, level 1, must not differ in a single bit.
    a, b = Replica(copy.deepcopy(base), cfg.lr), Replica(copy.deepcopy(base), cfg.lr)
    gate = 0
    for step in range(1, cfg.gate_steps + 1):
        _, _, rows = _level1_step(
            a, b, batch_inputs(blocks, step, cfg, cfg.seed), step, None, step, gen
        )
        gate += sum(r["mismatches"] for r in rows)
        a.update(), b.update()
    summary: dict[str, Any] = {
        "level": cfg.level,
        "gate_mismatches": gate,
        "deterministic": gate == 0,
    }
    tol = 0.0 if gate == 0 else cfg.tolerance
    if gate:
        summary["note"] = f"not bitwise deterministic: mismatches counted beyond {tol} relative"

    healthy, faulty = Replica(copy.deepcopy(base), cfg.lr), Replica(copy.deepcopy(base), cfg.lr)
    with (out / "steps.jsonl").open("w") as f:
        if cfg.level == 1:
            totals = defaultdict(lambda: [0, 0, 0.0])
            for step in range(1, cfg.steps + 1):
                inputs = batch_inputs(blocks, step, cfg, cfg.seed)
                _, _, rows = _level1_step(healthy, faulty, inputs, step, cfg.sdc, step, gen, tol)
                for r in rows:
                    f.write(json.dumps(r) + "\n")
                    t = totals[(r["submodule"], r["direction"])]
                    t[0] += r["elements"]
                    t[1] += r["mismatches"]
                    t[2] += r["severity"] * r["mismatches"]
                healthy.update(), faulty.update()
            elements = sum(t[0] for t in totals.values())
            mism = sum(t[1] for t in totals.values())
            summary |= {
                "mismatch_frequency": mism / elements,
                "mismatch_severity": sum(t[2] for t in totals.values()) / max(mism, 1),
                "by_submodule": {
                    f"{k[0]}/{k[1]}": {"frequency": t[1] / t[0], "severity": t[2] / max(t[1], 1)}
                    for k, t in totals.items()
                },
            }
        elif cfg.level == 2:
            nsr, cos = [], []
            for step in range(1, cfg.steps + 1):
                inputs, rng = batch_inputs(blocks, step, cfg, cfg.seed), step
                healthy.step(inputs, rng)
                faulty.step(inputs, rng, corrupting(cfg.sdc, step, gen))
                gh, gf = healthy.grads(), faulty.grads()
                nsr.append(float((gf - gh).norm() / gh.norm()))
                cos.append(float(torch.nn.functional.cosine_similarity(gf, gh, dim=0)))
                f.write(
                    json.dumps({"step": step, "gradient_nsr": nsr[-1], "cosine": cos[-1]}) + "\n"
                )
                healthy.update()
                faulty.model.load_state_dict(healthy.model.state_dict())
                faulty.opt.load_state_dict(healthy.opt.state_dict())
                faulty.opt.zero_grad(set_to_none=True)
            summary |= {
                "worst_gradient_nsr": max(nsr),
                "mean_gradient_nsr": sum(nsr) / len(nsr),
                "min_cosine": min(cos),
            }
        else:
            control = Replica(copy.deepcopy(base), cfg.lr)
            losses = defaultdict(list)
            for step in range(1, cfg.steps + 1):
                arms = [
                    ("healthy", healthy, cfg.seed, None),
                    ("control", control, cfg.control_seed, None),
                ]
                arms.append(("faulty", faulty, cfg.seed, corrupting(cfg.sdc, step, gen)))
                for name, rep, seed, hook in arms:
                    losses[name].append(rep.step(batch_inputs(blocks, step, cfg, seed), step, hook))
                    rep.update()
                drift = {
                    "drift": _drift(faulty.model, healthy.model),
                    "control_drift": _drift(control.model, healthy.model),
                }
                f.write(
                    json.dumps({"step": step, **{k: v[-1] for k, v in losses.items()}, **drift})
                    + "\n"
                )
            held = batch_inputs(blocks, 10_000, cfg, cfg.seed + 99)
            summary |= {
                "final_param_drift": _drift(faulty.model, healthy.model),
                "control_param_drift": _drift(control.model, healthy.model),
                "per_layer_drift": _layer_drift(faulty.model, healthy.model),
                "loss_spikes": sum(
                    1
                    for x in losses["faulty"]
                    if not x < 10 * max(losses["healthy"][: min(100, len(losses["healthy"]))])
                ),
                "final_loss": {k: v[-1] for k, v in losses.items()},
                "prediction_divergence": prediction_divergence(faulty.model, healthy.model, held),
                "control_prediction_divergence": prediction_divergence(
                    control.model, healthy.model, held
                ),
            }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "meta.json").write_text(
        json.dumps({"config": {**cfg.__dict__, "sdc": cfg.sdc.__dict__}}, indent=2, default=str)
    )
    return summary


def corrupting(sdc: SDCModel, step: int, gen: torch.Generator):
    def hook(name, layer, kind):
        rate = sdc.rate if kind == "attention" else sdc.mlp_rate

        def fwd(module, args, output):
            t = output_tensor(output)
            if t is None or not sdc.active(step):
                return
            if sdc.forward:
                sdc.corrupt_(t.data, site_rate=rate, generator=gen)
            if sdc.backward and t.requires_grad:

                def on_grad(g: Tensor) -> Tensor:
                    g = g.clone()
                    sdc.corrupt_(g, site_rate=rate, generator=gen)
                    return g

                t.register_hook(on_grad)

        return fwd

    return hook


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _drift(a: nn.Module, b: nn.Module) -> float:
    return float((_flat(a) - _flat(b)).norm() / _flat(b).norm())


def _layer_drift(a: nn.Module, b: nn.Module) -> dict[str, float]:
    out: dict[str, list[Tensor]] = defaultdict(list)
    pb = dict(b.named_parameters())
    for n, p in a.named_parameters():
        key = ".".join(n.split(".")[:4])
        out[key].append(torch.stack([(p - pb[n]).norm() ** 2, pb[n].norm() ** 2]).detach())
    return {
        k: float(torch.stack(v).sum(0)[0].sqrt() / torch.stack(v).sum(0)[1].sqrt())
        for k, v in out.items()
    }


@torch.no_grad()
def prediction_divergence(a: nn.Module, b: nn.Module, inputs: dict[str, Tensor]) -> float:
    a.eval(), b.eval()
    pa, pb = a(**inputs).logits.argmax(-1), b(**inputs).logits.argmax(-1)
    a.train(), b.train()
    return float((pa != pb).float().mean())
