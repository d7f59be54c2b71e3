"""The model-agnostic attention core with checks: scores, softmax probabilities, context.

:func:`attend` reproduces the eager attention of each supported family exactly (a
:class:`CoreSpec` says how the family differs) from tensors alone (the module is never read
here), and, given an :class:`~attnchecker.attention.state.AttentionState`, runs the named sites
and the checks between the steps:

    scores = q k^T            site "scores", checked and repaired per (batch, head)
    probs  = softmax(scores * scaling + mask)   site "probs", rows must sum to 1
    probs  = dropout(probs)
    context = probs v         site "context", checked and repaired per (batch, head)

Q and K enter the scores check as its operands after anything that sits between the
projections and the core (rotary embeddings), so the check holds whatever that is. Grouped K/V
heads (GQA / MQA) follow from the shapes: H query heads over Hkv key/value heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnchecker.attention.checks import (
    context_residual,
    heads_repair_,
    probs_residual,
    scores_residual,
)
from attnchecker.attention.handoff import Handoff
from attnchecker.attention.state import AttentionState, _ranged

__all__ = ["CoreSpec", "attend"]


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
) -> tuple[Tensor, Tensor]:
    """Eager attention of q (B, H, L, d), k and v (B, Hkv, Lk, d): returns (output, probs).

    ``causal`` is GPT-Neo's boolean (1, 1, L, Lk) mask applied with ``finfo.min`` before the
    attention mask; ``upcast_reordered`` is GPT-2's ``reorder_and_upcast_attn``: fp32 scores with
    the scaling folded into the GEMM.
    """
    v_sums = None
    if state is not None:
        state.flush()  # projections still waiting for their group (e.g. Q alone)
        handoff, state.handoff = state.handoff, None
        if isinstance(handoff, Handoff) and state.config.mode == "passing":
            v_sums = handoff.for_core(value)
    B, H, L, d = query.shape
    n_rep = H // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    if spec.upcast_qk:
        query, key = query.to(torch.float32), key.to(torch.float32)
    Lk = key.shape[-2]
    alpha = scaling if upcast_reordered else 1.0

    def scores_of(b: Tensor | None = None, h: Tensor | None = None) -> Tensor:
        q, k = (query, key) if b is None else (query[b, h], key[b, h])
        if upcast_reordered:
            with torch.autocast(q.device.type, enabled=False):
                q3, k3 = q.reshape(-1, L, d).float(), k.reshape(-1, Lk, d).float()
                out = torch.baddbmm(
                    torch.empty(q3.shape[0], L, Lk, device=q.device), q3, k3.mT, beta=0, alpha=alpha
                )
            return out.view(*q.shape[:-2], L, Lk)
        return torch.matmul(q, k.transpose(-1, -2))

    def probs_of(scores: Tensor, b: Tensor | None = None, h: Tensor | None = None) -> Tensor:
        z = scores
        if spec.scale and not upcast_reordered:
            z = z * scaling
        if causal is not None:
            bias = causal if b is None else causal.expand(B, H, L, Lk)[b, h]
            z = torch.where(bias, z, torch.finfo(z.dtype).min)
        if attention_mask is not None:
            z = z + (attention_mask if b is None else attention_mask.expand(B, H, L, Lk)[b, h])
        if spec.softmax_fp32:
            return nn.functional.softmax(z, dim=-1, dtype=torch.float32).to(query.dtype)
        p = nn.functional.softmax(z, dim=-1)
        return p.type(value.dtype) if spec.probs_to_value_dtype else p

    config = None if state is None else state.config
    heads = 0 if state is None else config.max_heads
    scale = 1.0 if state is None else config.tolerance_scale

    def check(op: str, t: Tensor, residual: Callable[[], tuple[Tensor, Tensor]], recompute) -> None:
        """The site's hooks, then the op's check and repair of t (when it is checked)."""
        state.site(op, t)
        if state.checks(op):
            with _ranged(op):
                res, excess = residual()
                state.note((op,), heads_repair_(t, res, excess, recompute, max_heads=heads))

    scores = scores_of()  # (B, H, L, Lk)
    if state is not None:
        check(
            "scores", scores,
            lambda: scores_residual(scores, query, key, alpha=alpha, scale=scale),
            scores_of,
        )  # fmt: skip
    probs = probs_of(scores)  # (B, H, L, Lk)
    if state is not None:
        check(
            "probs", probs,
            lambda: probs_residual(probs, scale=scale),
            lambda b, h: probs_of(scores[b, h], b, h),
        )  # fmt: skip
    probs = nn.functional.dropout(probs, p=dropout, training=training)
    context = torch.matmul(probs, value)  # (B, H, L, d)
    if state is not None:
        if v_sums is not None and n_rep > 1:
            v_sums = tuple(t.repeat_interleave(n_rep, dim=1) for t in v_sums)
        check(
            "context", context,
            lambda: context_residual(context, probs, value, scale=scale, v_sums=v_sums),
            lambda b, h: torch.matmul(probs[b, h], value[b, h]),
        )  # fmt: skip
        if not state.checks("out"):
            state.commit()  # otherwise the output projection's check writes the layer's records
    if spec.transpose_out:
        context = context.transpose(1, 2)
        if spec.contiguous_out:
            context = context.contiguous()
    return context, probs
