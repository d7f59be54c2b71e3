"""The SDPA route of the attention core (``backend="sdpa"``): the model's own fast attention
kernel, checked by what it returns.

:func:`checked_attention` runs the aten op that ``F.scaled_dot_product_attention`` runs (flash or
memory-efficient on CUDA, the flash kernel on a CPU) inside one autograd function, so that each
row's log-sum-exp is at hand, and checks, forward and backward, with the invariants of
:mod:`attnchecker.kernels.sdpa_check` (a few reductions per layer; nothing of size L x L): the
LSE bound for the scores, V's range for the context, the exact sums of dV and dK and the bound
of dQ in the backward. A flagged (batch, head) is recomputed and written in place by a repair
op that does nothing on a clean call.

The config's ops map onto these checks: ``scores`` the LSE bound; ``context`` (or ``probs``
alone: P is not materialised, a fault in it reaches O) the range of O; ``dv`` the dV sum;
``dk`` the dK sum and ``dq`` the dQ bound (``dp`` alone: both, a fault in dP reaches dS, which
they see).

Faults at the core's named sites (scores, probs, context; dp, dv, dq, dk) are emulated: with a
hook attached, the call also computes S, P and O (and dP, dV, dS, dQ, dK) in eager math, runs the
hooks on them and, for the (batch, head) pairs a hook changed, moves what the kernel returned by
what the corruption changed in the eager math (the corrupted result less the clean one: the
fault's effect alone, not the eager math's rounding against the kernel's, which a small fault's
campaign would otherwise count as its effect), before the checks. So a campaign measures what
this route detects; nothing of the kind runs without a hook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnchecker.abft.cast import autocast_operands
from attnchecker.attention.grads import GradSite
from attnchecker.attention.masks import bias_from_sdpa
from attnchecker.attention.ops import CORE_GRAD_OPS, OPS, ROUTE_CHECKS, op
from attnchecker.attention.sites import Sites
from attnchecker.attention.state import AttentionState
from attnchecker.kernels.constants import device_constant
from attnchecker.kernels.sdpa_backend import (
    attention_backward,
    attention_forward,
    backend_mask,
    dropout_keep,
    expand_kv,
    group_sum,
    probe_gqa,
    rng_state,
)
from attnchecker.kernels.sdpa_check import REFERENCE, SdpaOps, mask_facts
from attnchecker.kernels.sdpa_sample import BWD_SAMPLE, FWD_SAMPLE, coverage

__all__ = ["SdpaPlan", "checked_attention", "self_test"]

_FWD_SITES = tuple(o for o in OPS if op(o).part == "core")  # scores, probs, context
_FWD_CHECKS, _BWD_CHECKS = ("lse", "range"), ("dq_bound", "dk_sum", "dv_sum")


def _changed(before: Tensor, after: Tensor) -> Tensor:
    """(B, H) bool: which matrices a hook changed (NaN where there was none counts)."""
    return (~(after == before)).flatten(2).any(-1)


def _emulate_forward(sites, q, k, v, mask, causal, scale, out, lse, keep=None) -> None:
    """The forward's sites on eager S, P, O: what a hook changed replaces ``out`` / ``lse``
    (``keep``: the call's dropout draw, scaled: what multiplies P before V)."""
    H, L, Lk = q.shape[1], q.shape[2], k.shape[2]
    if sites.hooks.get("scores") or sites.hooks.get("probs"):
        ke, ve = expand_kv(k, H), expand_kv(v, H)
        bias = bias_from_sdpa(mask, causal, L, Lk, q.device)
        s = q @ ke.mT  # (B, H, L, Lk)
        s0 = s.clone()
        sites.run("scores", s)
        hit = _changed(s0, s)
        z, z0 = (t.float() * scale + bias for t in (s, s0))
        p, p0 = (torch.softmax(t, -1).nan_to_num(0.0).to(q.dtype) for t in (z, z0))  # no key: 0
        before = p.clone()
        sites.run("probs", p)
        heads = hit | _changed(before, p)
        o, o0 = (((t if keep is None else (t * keep).to(t.dtype)) @ ve).float() for t in (p, p0))
        out.copy_(torch.where(heads[..., None, None], _moved(out, o - o0), out))
        moved = lse + (torch.logsumexp(z, -1) - torch.logsumexp(z0, -1))
        lse.copy_(torch.where(hit[..., None], moved, lse))
    sites.run("context", out)


def _moved(t: Tensor, delta: Tensor) -> Tensor:
    """What the kernel's ``t`` becomes under a fault whose eager emulation moved it by ``delta``
    (fp32): the fault's effect alone, not the eager math's own rounding against the kernel's."""
    return (t.float() + delta).to(t.dtype)


def _emulate_backward(hook, q, k, v, mask, causal, scale, out, grad, dq, dk, dv,
                      keep=None) -> None:  # fmt: skip
    """The backward's sites on eager dP, dV, dQ, dK (dS from the possibly corrupted dP):
    what a hook changed replaces the kernel's gradients of those heads (dK, dV: their group);
    ``keep``: the forward's dropout draw, scaled (dP is the gradient of the undropped P)."""
    H, L, Lk = q.shape[1], q.shape[2], k.shape[2]
    Hkv = k.shape[1]
    ke, ve = expand_kv(k, H), expand_kv(v, H)
    z = (q @ ke.mT).float() * scale + bias_from_sdpa(mask, causal, L, Lk, q.device)
    p = torch.softmax(z, -1).nan_to_num(0.0)  # (B, H, L, Lk) fp32
    found, clean = {}, {}
    dp = grad @ ve.mT  # (B, H, L, Lk)
    w = p if keep is None else p * keep
    if keep is not None:
        dp = (dp * keep).to(dp.dtype)
    dvf = w.to(q.dtype).mT @ grad  # (B, H, Lk, d)
    for site, t in (("dp", dp), ("dv", dvf)):
        clean[site] = t.clone()
        hook(site, t)
        found[site] = _changed(clean[site], t)
    dsum = (grad.float() * out.float()).sum(-1, keepdim=True)
    ds, ds0 = ((p * (t.float() - dsum)).to(q.dtype) for t in (dp, clean["dp"]))
    dq0, dk0 = (ds0 @ ke) * scale, (ds0.mT @ q) * scale
    dqf, dkf = (ds @ ke) * scale, (ds.mT @ q) * scale
    for site, t in (("dq", dqf), ("dk", dkf)):
        before = t.clone()
        hook(site, t)
        found[site] = _changed(before, t)
    # each gradient moved by what the emulated fault changed (the kernel's own rounding kept)
    heads = found["dp"] | found["dq"]
    dq.copy_(torch.where(heads[..., None, None], _moved(dq, dqf.float() - dq0.float()), dq))
    changed = (found["dp"] | found["dk"] | found["dv"]).float()
    groups = (group_sum(changed, Hkv) > 0)[..., None, None]
    for t, new, old in ((dk, dkf, dk0), (dv, dvf, clean["dv"])):
        t.copy_(torch.where(groups, _moved(t, group_sum(new.float() - old.float(), Hkv)), t))


def _ops(kernels: bool) -> SdpaOps:
    """The check ops as the module's implementation runs them: the Triton kernels' family
    (``kernels``: CUDA, or the interpreter) or the torch reference's."""
    if not kernels:
        return REFERENCE
    from attnchecker.kernels.sdpa_kernels_bwd import TRITON_OPS

    return TRITON_OPS


@dataclass(frozen=True)
class SdpaPlan:
    """What one call of the SDPA route does around the backend's kernel."""

    causal: bool  # top-left aligned, as SDPA's
    scale: float
    tol: float  # the config's tolerance_scale
    fwd_rows: tuple[int, int]  # log rows of the scores and context checks (-1: not recorded)
    fwd_on: bool  # any forward check runs
    bwd_rows: tuple[int, int, int]  # sink rows of the dq, dk, dv checks (-1: not recorded)
    bwd_on: bool  # any backward check runs
    n_grad: int  # rows of the backward's records
    dropout: float  # the kernel's attention dropout (training), 0: none
    sites: Sites | None  # the forward's sites, where a hook waits at one (emulated faults)
    hook: GradSite | None  # the backward's site runner, or None
    ops: SdpaOps  # the check ops: the Triton kernels' or the torch reference's
    samples: int = 0  # query (and key) rows recomputed per (batch, head) and call (0: none)
    salt: int = 0  # the module's part of the sampled rows' draw (its layer)


class _Checked(torch.autograd.Function):
    """The backend's attention and its checks: forward (q, k, v, mask, sink, step, log,
    rowmax, plan) -> (out, lse); the backward's records are the gradient of ``sink``."""

    @staticmethod
    def forward(ctx, q, k, v, mask, sink, step, log, rowmax, plan: SdpaPlan):
        p = plan.dropout
        rng = rng_state(q.device) if p > 0 else None  # the draw's start: what a rerun rewinds to
        out, lse, aux = attention_forward(q, k, v, mask, plan.causal, plan.scale, p)
        keep = None
        if p > 0 and (plan.sites is not None or plan.hook is not None):  # emulated faults
            keep = dropout_keep(q, k, v, mask, plan.causal, plan.scale, p, rng) / (1 - p)
        if plan.sites is not None:
            _emulate_forward(plan.sites, q, k, v, mask, plan.causal, plan.scale, out, lse, keep)
        stats, ops, rows = None, plan.ops, list(plan.fwd_rows)
        if plan.fwd_on:
            stats = ops.kv_stats(k, v)
            flags = ops.fwd_verify(q, k, out, lse, stats, log, step, rows, plan.scale, rowmax,
                                   plan.tol, p)  # fmt: skip
            if plan.samples > 0 and p == 0:  # (a dropout call's draw is the kernel's: unsampled)
                FWD_SAMPLE(q, k, v, mask, out, lse, flags, log, step, rows, plan.causal,
                           plan.scale, plan.tol, plan.samples, plan.salt, ops is not REFERENCE)
            ops.fwd_repair(q, k, v, mask, out, lse, stats, flags, log, step, rows, plan.causal,
                           plan.scale, rowmax, plan.tol, p, rng)  # fmt: skip
        ctx.save_for_backward(q, k, v, mask, out, lse, stats, step, rowmax, rng, keep)
        ctx.plan, ctx.aux, ctx.sink = plan, aux, sink.numel() > 0
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        q, k, v, mask, out, lse, stats, step, rowmax, rng, keep = ctx.saved_tensors
        plan: SdpaPlan = ctx.plan
        causal, scale, tol, ops, p = plan.causal, plan.scale, plan.tol, plan.ops, plan.dropout
        grad = grad.contiguous()
        dq, dk, dv = attention_backward(grad, q, k, v, out, lse, mask, causal, scale, ctx.aux, p,
                                        rng)  # fmt: skip
        if plan.hook is not None:
            _emulate_backward(plan.hook, q, k, v, mask, causal, scale, out, grad, dq, dk, dv,
                              keep)  # fmt: skip
        rec = None
        if plan.bwd_on and ctx.sink:
            stats = ops.kv_stats(k, v) if stats is None else stats
            rec = torch.zeros(plan.n_grad, 7, dtype=torch.float64, device=q.device)
            rows = list(plan.bwd_rows)
            part, flags = ops.bwd_verify(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec,
                                         step, rows, scale, tol, p)  # fmt: skip
            if plan.samples > 0 and p == 0 and ops is REFERENCE:  # (flags: (B, Hkv) bits)
                BWD_SAMPLE(q, k, v, mask, out, lse, grad, dq, dk, dv, rowmax, flags, rec, step,
                           rows, causal, scale, tol, plan.samples, plan.salt)  # fmt: skip
            sums = ops.bwd_sums(dk, dv)
            ops.bwd_repair(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, part, flags,
                           sums, rec, step, rows, causal, scale, tol, p, rng)  # fmt: skip
        return dq, dk, dv, None, rec, None, None, None, None


def _facts(state: AttentionState, mask: Tensor | None, q: Tensor) -> tuple[Tensor | None, Tensor]:
    """(the mask as the backend takes it, each row's largest mask value: :func:`mask_facts`),
    once per mask and step (the layers share one mask); without a mask a zero made once per
    device (no host-to-device copy a call: a CUDA graph captures none)."""
    if mask is None:
        return None, device_constant(
            "no mask", q.device, lambda: torch.zeros(1, 1, 1, device=q.device)
        )
    return state.clock.memo.get(("sdpa_mask", q.dtype, q.shape[:3]), (mask,), lambda: (
        backend_mask(mask, q), mask_facts(mask, q.shape[2])))  # fmt: skip


def checked_attention(
    state: AttentionState, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
    causal: bool, scale: float, dropout: float = 0.0,
) -> Tensor:  # fmt: skip
    """SDPA of q (B, H, L, d), k and v (B, Hkv, Lk, d) (``mask``: 4-D bool or additive,
    broadcast to (B, H, L, Lk); ``causal`` top-left; ``dropout``: the kernel's attention
    dropout, in training) by the backend's kernel, with the checks the state asks for now:
    (B, H, L, d) in q's dtype. A dropout call's repairs read their flags on the host and rerun
    the backend's draw (:mod:`~attnchecker.kernels.sdpa_backend`)."""
    q, k, v = autocast_operands(q, k, v)  # (RoPE can leave q and k fp32 while v is bf16)
    state.follow(q.device)  # moved without a root forward (a layer alone)
    mask, rowmax = _facts(state, mask, q)
    row, on = state.records.direct_row, state.checks
    fwd_rows = tuple(row(*ROUTE_CHECKS[c], on=on) for c in _FWD_CHECKS)
    bwd_rows = tuple(row(*ROUTE_CHECKS[c], on=on, grad=True) for c in _BWD_CHECKS)
    hooked = not torch.compiler.is_compiling() and any(state.hooks.get(s) for s in _FWD_SITES)
    plan = SdpaPlan(
        causal, scale, float(state.config.tolerance_scale),
        fwd_rows, any(state.checks(o) for o in _FWD_SITES),
        bwd_rows, any(state.checks(o) for o in CORE_GRAD_OPS), len(state.records.grad_ops),
        float(dropout), state.sites if hooked else None, state.sites.grad_hook(CORE_GRAD_OPS),
        _ops(state.impl.kernels), int(state.config.sampled_rows), state.layer,
    )  # fmt: skip
    if not torch.compiler.is_compiling():  # (what summary() says of the draw)
        state.coverage.sampled = coverage(plan.samples, q.shape[2], dropout=plan.dropout)
    sink = state.grads
    if sink is None or not torch.is_grad_enabled():
        sink = torch.zeros(0, device=q.device)  # (no backward records: an inert input)
    log = state.records.direct_log() if plan.fwd_on else state.records.log
    out, _ = _Checked.apply(q, k, v, mask, sink, state.clock.count, log, rowmax, plan)
    return out


_SELF_TESTS: dict[str, str | None] = {}


def self_test(device: torch.device | str) -> str | None:
    """Run the SDPA route once on ``device`` (a small causal GQA case and a padded one, forward
    and backward, bf16 on CUDA) against ``F.scaled_dot_product_attention``: None when it agrees
    and raises no alarm, else why not. Cached per device; ``backend="auto"`` takes the route only
    where it passes (a torch whose aten kernels take other arguments costs a warning, not a
    crash)."""
    from attnchecker.attention.config import ABFTConfig
    from attnchecker.attention.records import new_log
    from attnchecker.attention.state import Clock

    key = str(device)
    if key in _SELF_TESTS:
        return _SELF_TESTS[key]
    reason = None
    try:
        device = torch.device(device)
        probe_gqa(device)  # the flash kernel's own GQA where it has it (the run below uses it)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        clock = Clock(torch.zeros(1, dtype=torch.float64, device=device))
        state = AttentionState("self_test", 0, ABFTConfig(backend="sdpa"), clock,
                               new_log(device), backward=True)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, n, 80, 64, generator=g).to(device, dtype).requires_grad_()
                   for n in (4, 2, 2))  # fmt: skip
        keep = torch.ones(2, 1, 80, 80, dtype=torch.bool, device=device).tril()
        keep[1, :, :, :7] = False  # left padding
        with torch.enable_grad():  # (protect_ may be called under no_grad)
            errors = _self_test_errors(state, clock, device, q, k, v, keep)
        worst = max(float(e) for e in errors)
        if not worst <= (5e-2 if dtype == torch.bfloat16 else 1e-4):
            reason = f"results differ from SDPA by {worst:.2e}"
        elif bool(state.records.rows(clock.count)[:, 5].any()):
            reason = "false alarms on clean data"
    except Exception as exc:  # an aten kernel's other signature, a missing one: the reason
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _SELF_TESTS[key] = reason
    return reason


def _self_test_errors(state, clock, device, q, k, v, keep) -> list[Tensor]:
    """The self-test's largest differences from SDPA, output and gradients, causal then
    padded."""
    errors = []
    for mask, causal in ((None, True), (keep, False)):
        clock.tick(device)
        out = checked_attention(state, q, k, v, mask, causal=causal, scale=0.125)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=0.125, enable_gqa=True
        )
        wants = torch.autograd.grad(want.float().sum(), (q, k, v))
        live = slice(None) if mask is None else (0,)  # (SDPA's rows of no key: its own)
        errors += [(out - want).detach()[live].abs().max()] + [
            (a - b)[live].abs().max() for a, b in zip(grads, wants, strict=True)
        ]
    return errors
