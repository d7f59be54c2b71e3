"""The model-agnostic attention core with checks: scores, softmax probabilities, context.

:func:`attend` reproduces the eager attention of each supported family exactly (a
:class:`CoreSpec` says how the family differs) from tensors alone (the module is never read
here), and, given an :class:`~attnchecker.attention.state.AttentionState`, runs the named sites
and the checks between the steps:

    scores = q k^T            site "scores", rows checked against q . sum_j k_j
    probs  = softmax(cap(scores * scaling) + mask)   site "probs", rows must sum to 1
    mixed  = dropout(probs)   (training with dropout > 0: as F.dropout runs, its draw kept)
    context = mixed v         site "context", rows checked against mixed . sum_f v_f

and then one repair for all three: the ``max_heads`` (batch, head) matrices with the most
flagged rows have their scores -> probs -> dropout -> context recomputed from q, k, v (and the
kept dropout mask), written into every tensor autograd saved. Checking first and repairing once
costs one set of index ops per layer instead of one per op; a fault in the scores reaches the
probabilities and the context before the repair, which is why the chain is recomputed whole.
Without dropout the probabilities' row sums ride on the context's reference GEMM.

Q and K enter the scores check as its operands after anything that sits between the
projections and the core (rotary embeddings), so the check holds whatever that is. Grouped K/V
heads (GQA / MQA) follow from the shapes: H query heads over Hkv key/value heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnchecker.abft.cast import autocast_operands
from attnchecker.attention import regions
from attnchecker.attention.grads import checked_matmul
from attnchecker.attention.heads import (
    context_residual,
    heads_repair_,
    probs_residual,
    scores_residual,
)
from attnchecker.attention.records import ranged
from attnchecker.attention.state import AttentionState

__all__ = ["CORE", "CoreSpec", "attend", "output_layout"]

CORE = "_attnchecker_core"
"""Attribute that carries (CoreSpec, AttentionState | None) on every attention core module."""


@dataclass(frozen=True)
class CoreSpec:
    """How one family's eager attention differs from the common pattern."""

    upcast_qk: bool = False  # GPT-Neo: q and k go to fp32 before the scores GEMM
    scale: bool = True  # multiply the scores by `scaling` (GPT-Neo does not scale)
    softmax_fp32: bool = False  # Llama: softmax in fp32, then back to the query dtype
    probs_to_value_dtype: bool = False  # GPT-2, GPT-Neo: probs.type(value.dtype)
    transpose_out: bool = True  # return (B, L, nh, d); False returns (B, nh, L, d)
    contiguous_out: bool = True


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, nkv, L, d) -> (B, nkv * n_rep, L, d), as transformers' repeat_kv."""
    if n_rep == 1:
        return x
    B, nkv, L, d = x.shape
    return x[:, :, None].expand(B, nkv, n_rep, L, d).reshape(B, nkv * n_rep, L, d)


def attend(
    spec: CoreSpec,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None,
    dropout: float,
    training: bool,
    state: AttentionState | None = None,
    causal: Tensor | None = None,
    upcast_reordered: bool = False,
    softcap: float | None = None,
    v_sums: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Eager attention of q (B, H, L, d), k and v (B, Hkv, Lk, d): returns (output, probs).

    ``causal`` is GPT-Neo's boolean (1, 1, L, Lk) mask applied with ``finfo.min`` before the
    attention mask; ``upcast_reordered`` is GPT-2's ``reorder_and_upcast_attn``: fp32 scores with
    the scaling folded into the GEMM; ``softcap`` is Gemma 2's logit soft-capping,
    softcap * tanh(z / softcap) of the scaled scores before the mask; ``v_sums``: V's row sums
    and their bound from its projection's check (``mode="passing"``), for the context check.
    With a ``state``, :func:`~attnchecker.attention.engines.run_core` runs it (its set-up before
    it, its commit after it).
    """
    B, H, L, d = query.shape
    n_rep = H // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    if spec.upcast_qk:
        query, key = query.to(torch.float32), key.to(torch.float32)
    Lk = key.shape[-2]
    alpha = scaling if upcast_reordered else 1.0

    def scores_of(b: Tensor | None = None, h: Tensor | None = None) -> Tensor:
        # the repair's recomputation (b, h given) reads the operands' data: a check region
        # takes no autograd tensor (aliases of one, e.g. x and x.data, do not compile)
        q, k = (query, key) if b is None else (query.data[b, h], key.data[b, h])
        if upcast_reordered:
            with torch.autocast(q.device.type, enabled=False):
                q3, k3 = q.reshape(-1, L, d).float(), k.reshape(-1, Lk, d).float()
                out = torch.baddbmm(
                    torch.empty(q3.shape[0], L, Lk, device=q.device), q3, k3.mT, beta=0, alpha=alpha
                )
            return out.view(*q.shape[:-2], L, Lk)
        return torch.matmul(q, k.transpose(-1, -2))

    def probs_of(
        scores: Tensor, b: Tensor | None = None, h: Tensor | None = None
    ) -> tuple[list[Tensor], Tensor]:
        """(what autograd saves between the scores and the probabilities: the soft-capping's
        tanh output, the softmax output; the probabilities in the dtype the family delivers,
        the softmax output itself unless the family converts)."""
        z, saved = scores, []
        if spec.scale and not upcast_reordered:
            z = z * scaling
        if softcap is not None:
            t = torch.tanh(z / softcap)
            z, saved = t * softcap, [t]
        if causal is not None:
            bias = causal if b is None else causal.expand(B, H, L, Lk)[b, h]
            z = torch.where(bias, z, torch.finfo(z.dtype).min)
        if attention_mask is not None:
            z = z + (attention_mask if b is None else attention_mask.expand(B, H, L, Lk)[b, h])
        if spec.softmax_fp32:
            p = nn.functional.softmax(z, dim=-1, dtype=torch.float32)
            return [*saved, p], p.to(query.dtype)
        p = nn.functional.softmax(z, dim=-1)
        return [*saved, p], (p.type(value.dtype) if spec.probs_to_value_dtype else p)

    checked = state is not None and state.grads is not None and torch.is_grad_enabled()
    if checked and not upcast_reordered:  # backward: dQ, dK checked (and dP, dV below)
        scores = checked_matmul(
            query, key.transpose(-1, -2), state.grads, state.clock.count,
            ops=("dq", "dk"), check=(state.checks("dq"), state.checks("dk")), b_transposed=True,
            max_heads=state.config.max_heads, scale=state.config.tolerance_scale,
            hook=state.grad_hook(), impl=state.impl,
        )  # fmt: skip
    else:
        scores = scores_of()  # (B, H, L, Lk)
    if state is None:
        probs = probs_of(scores)[1]
        probs = nn.functional.dropout(probs, p=dropout, training=training)
        context = torch.matmul(probs, value)
        return output_layout(spec, context), probs

    config, on = state.config, state.checks
    # One repair for the layer's head checks: the worst heads' scores -> probs -> dropout ->
    # context recomputed together after the context (dropout's draw kept for it).
    dropping = training and dropout > 0
    state.site("scores", scores)
    saved, probs = probs_of(scores)  # [(B, H, L, Lk)...], (B, H, L, Lk)
    state.site("probs", probs)
    converts = probs is not saved[-1]
    targets = [*saved, probs] if converts else [*saved]  # what the repair writes
    mixed, redo = probs, None
    if dropping:
        mixed, redo = _dropout(probs, dropout)
        targets.append(mixed)
    if checked:
        cast = autocast_operands(mixed)[0]  # what the GEMM multiplies, saved for dV
        if cast is not mixed:
            targets.append(cast)
        context = checked_matmul(
            cast, value, state.grads, state.clock.count,
            ops=("dp", "dv"), check=(on("dp"), on("dv")), nonneg_a=True,
            max_heads=state.config.max_heads, scale=state.config.tolerance_scale,
            hook=state.grad_hook(), impl=state.impl,
        )  # fmt: skip
    else:
        context = torch.matmul(mixed, value)  # (B, H, L, d)
    state.site("context", context)
    targets.append(context)
    if v_sums is not None and n_rep > 1:
        v_sums = tuple(t.repeat_interleave(n_rep, dim=1) for t in v_sums)
    # the probabilities' sums ride on the context's reference GEMM (no dropout between them)
    probs_how = None if not on("probs") else "alone" if dropping else "ride"
    ops = tuple(op for op in ("scores", "probs", "context") if on(op))

    def chain(b: Tensor, h: Tensor) -> list[Tensor]:
        new_scores = scores_of(b, h)
        new_saved, new_probs = probs_of(new_scores, b, h)
        news = [*new_saved, new_probs] if converts else new_saved
        if redo is not None:
            new_probs = redo(new_probs, b, h)
            news.append(new_probs)
        if checked and cast is not mixed:
            news.append(new_probs)
        return [*news, torch.matmul(new_probs, value.data[b, h]), new_scores]

    if ops:
        with ranged("core"):
            rec = regions.run(
                _core_region, state.impl.region(context.dtype),
                *(t.data for t in (scores, query, key, probs, mixed, value, context)), v_sums,
                [t.data for t in targets], chain,
                alpha=alpha, scale=config.tolerance_scale, max_heads=config.max_heads,
                check_scores=on("scores"), probs_how=probs_how, check_context=on("context"),
            )  # fmt: skip
        state.note(ops, rec)
    return output_layout(spec, context), mixed


def _core_region(
    scores: Tensor,
    query: Tensor,
    key: Tensor,
    probs: Tensor,
    mixed: Tensor,
    value: Tensor,
    context: Tensor,
    v_sums: tuple[Tensor, Tensor] | None,
    targets: list[Tensor],
    chain: Callable[[Tensor, Tensor], list[Tensor]],
    *,
    alpha: float,
    scale: float,
    max_heads: int,
    check_scores: bool,
    probs_how: str | None,
    check_context: bool,
) -> Tensor:
    """The core's checks and their one repair (a check region): the (residual, excess) of the
    scores, the probabilities (``probs_how``: ``"alone"``, or ``"ride"`` on the context's
    reference GEMM when ``mixed``, what multiplies V, is ``probs`` itself: no dropout) and the
    context, in chain order, then :func:`heads_repair_` of ``targets`` (B, H, L, M_i) by
    ``chain``. Returns the records, one per check."""
    found: list[tuple[Tensor, Tensor]] = []
    if check_scores:
        found.append(scores_residual(scores, query, key, alpha=alpha, scale=scale))
    ride = probs_how == "ride"
    if probs_how == "alone" or (ride and not check_context):
        found.append(probs_residual(probs, scale=scale))
    if check_context:
        res = context_residual(context, mixed, value, scale=scale, v_sums=v_sums, with_probs=ride)
        if ride:
            found.append(res[2:])
        found.append(res[:2])
    return heads_repair_(targets, found, chain, max_heads=max_heads, probe=scores)


def _dropout(x: Tensor, p: float) -> tuple[Tensor, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """``F.dropout(x, p, training=True)`` exactly as it runs on x's device (the fused
    native_dropout on CUDA, the composite bernoulli noise on CPU: values and gradients bitwise
    the same), keeping what it drew: (output, redo), redo(new, b, h) applying the same dropout to
    recomputed matrices new (Kh, L, Lk) of the (batch, head) pairs b, h."""
    fused = x.device.type in ("cuda", "xpu", "lazy", torch._C._get_privateuse1_backend_name())
    if fused and 0 < p < 1 and x.numel() > 0:
        out, keep = torch.native_dropout(x, p, True)
        return out, lambda new, b, h: new * keep[b, h] * (1 / (1 - p))
    if p >= 1:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return x * zero, lambda new, b, h: new * zero
    if torch.compiler.is_compiling():  # inductor draws its own numbers; its lowering of
        # bernoulli_ on a fresh empty_like, fused into the GEMM's input, gave NaN (torch 2.13)
        noise = (torch.rand_like(x) < 1 - p).to(x.dtype) * (1 / (1 - p))
    else:
        noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * noise, lambda new, b, h: new * noise[b, h]


def output_layout(spec: CoreSpec, context: Tensor) -> Tensor:
    """The context (B, H, L, d) in the layout the family returns."""
    if spec.transpose_out:
        context = context.transpose(1, 2)
        if spec.contiguous_out:
            context = context.contiguous()
    return context
