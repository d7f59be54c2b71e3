"""The model-agnostic attention core with checks: scores, softmax probabilities, context.

:func:`attend` reproduces the eager attention of each supported family exactly (a
:class:`CoreSpec` says how the family differs) and, when the module carries an
:class:`~attnchecker.attention.state.AttentionState`, runs the named sites and the checks
between the steps:

    scores = q k^T            site "scores", checked and repaired per (batch, head)
    probs  = softmax(scores * scaling + mask)   site "probs", rows must sum to 1
    probs  = dropout(probs)
    context = probs v         site "context", checked and repaired per (batch, head)

Q and K enter the scores check as its operands after any rotary embedding (Llama's RoPE breaks
checksum passing from the projection input X to Q and K, so the check takes Q and K as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from attnchecker.attention.checks import context_check_, probs_check_, scores_check_
from attnchecker.attention.state import AttentionState

__all__ = ["CoreSpec", "attend"]


@dataclass(frozen=True)
class CoreSpec:
    """How one family's eager attention differs from the common pattern."""

    repeat_kv: bool = False  # Llama: K/V have fewer heads, repeated num_key_value_groups times
    upcast_qk: bool = False  # GPT-Neo: q and k go to fp32 before the scores GEMM
    scale: bool = True  # multiply the scores by `scaling` (GPT-Neo does not scale)
    causal_bias: bool = False  # GPT-Neo: where(module.bias, scores, finfo.min) before the mask
    softmax_fp32: bool = False  # Llama: softmax in fp32, then back to the query dtype
    probs_to_value_dtype: bool = False  # GPT-2, GPT-Neo: probs.type(value.dtype)
    transpose_out: bool = True  # return (B, L, nh, d); False returns (B, nh, L, d)
    contiguous_out: bool = True
    has_rope: bool = False  # rotary embeddings rotate Q and K between projection and scores
    rope_scale: float | None = None  # their cos/sin scale, when known


def _head_major(t: Tensor, n_rep: int) -> Tensor:
    """(B, L, Hkv) per-token, per-head values -> (B, Hkv * n_rep, L), K/V heads repeated."""
    t = t.transpose(1, 2)
    return t.repeat_interleave(n_rep, dim=1) if n_rep > 1 else t


def _passed_bounds(state: AttentionState | None, spec: CoreSpec, n_rep: int):
    """The bounds the projection checks left (``mode="passing"``), in the core's layout.

    Rotary embeddings mix feature pairs of a head: |rot(q)_f| <= s (|q_f| + |q_f'|), which at most
    doubles (times the cos/sin scale s) a head's L1 norm of Q and the per-feature bound of K.
    """
    if state is None or state.config.mode != "passing":
        return None, None
    q_rows, k_feat = state.passing.pop("q_rows", None), state.passing.pop("k_features", None)
    v_rows = state.passing.pop("v_rows", None)
    scores_bounds = None
    if (
        q_rows is not None
        and k_feat is not None
        and (spec.rope_scale is not None or not spec.has_rope)
    ):
        rope = 1.0 if not spec.has_rope else 2.0 * spec.rope_scale
        B = k_feat.shape[0]
        n_kv = q_rows.shape[-1] // n_rep
        k_max = k_feat.view(B, n_kv, -1).amax(-1)  # (B, Hkv)
        k_max = k_max.repeat_interleave(n_rep, dim=1) if n_rep > 1 else k_max
        scores_bounds = (q_rows.transpose(1, 2) * rope, k_max * rope)
    if v_rows is not None:
        v_rows = tuple(_head_major(t, n_rep) for t in v_rows)
    return scores_bounds, v_rows


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, nkv, L, d) -> (B, nkv * n_rep, L, d), as transformers' repeat_kv."""
    if n_rep == 1:
        return x
    B, nkv, L, d = x.shape
    return x[:, :, None].expand(B, nkv, n_rep, L, d).reshape(B, nkv * n_rep, L, d)


def _site_and_check(
    state: AttentionState | None, op: str, tensor: Tensor, check: Callable[[], Tensor]
) -> None:
    """Run the site's hooks on ``tensor``, then its check (in a profiler range) if enabled."""
    if state is None:
        return
    state.site(op, tensor)
    if state.checks(op):
        with record_function(f"attnchecker.{op}"):
            rec = check()
        state.record(op, rec)


def attend(
    module: nn.Module,
    spec: CoreSpec,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None,
    dropout: float,
    state: AttentionState | None = None,
    upcast_reordered: bool = False,
) -> tuple[Tensor, Tensor]:
    """Eager attention of q (B, nh, L, d), k and v (B, nkv, Lk, d): returns (output, probs).

    ``upcast_reordered`` is GPT-2's ``reorder_and_upcast_attn``: fp32 scores with the scaling
    folded into the GEMM.
    """
    n_rep = module.num_key_value_groups if spec.repeat_kv else 1
    scores_bounds, v_rows = _passed_bounds(state, spec, n_rep)
    if spec.repeat_kv:
        key = _repeat_kv(key, n_rep)
        value = _repeat_kv(value, n_rep)
    if spec.upcast_qk:
        query, key = query.to(torch.float32), key.to(torch.float32)
    B, H, L, d = query.shape
    Lk = key.shape[-2]
    scale = 1.0 if state is None else state.config.tolerance_scale
    heads = 1 if state is None else state.config.max_heads
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
        if spec.causal_bias:
            bias = module.bias[:, :, Lk - L : Lk, :Lk]
            bias = bias if b is None else bias.expand(B, H, L, Lk)[b, h]
            z = torch.where(
                bias, z, torch.tensor(torch.finfo(z.dtype).min, dtype=z.dtype, device=z.device)
            )
        if attention_mask is not None:
            z = z + (attention_mask if b is None else attention_mask.expand(B, H, L, Lk)[b, h])
        if spec.softmax_fp32:
            return nn.functional.softmax(z, dim=-1, dtype=torch.float32).to(query.dtype)
        p = nn.functional.softmax(z, dim=-1)
        return p.type(value.dtype) if spec.probs_to_value_dtype else p

    scores = scores_of()  # (B, nh, L, Lk)
    _site_and_check(
        state, "scores", scores,
        lambda: scores_check_(
            scores, query, key, alpha=alpha, recompute=scores_of, max_heads=heads, scale=scale,
            bounds=scores_bounds,
        ),
    )  # fmt: skip
    probs = probs_of(scores)  # (B, nh, L, Lk)
    _site_and_check(
        state, "probs", probs,
        lambda: probs_check_(
            probs, recompute=lambda b, h: probs_of(scores[b, h], b, h), max_heads=heads, scale=scale
        ),
    )  # fmt: skip
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    context = torch.matmul(probs, value)  # (B, nh, L, d)
    _site_and_check(
        state, "context", context,
        lambda: context_check_(
            context, probs, value, recompute=lambda b, h: torch.matmul(probs[b, h], value[b, h]),
            max_heads=heads, scale=scale, v_rows=v_rows,
        ),
    )  # fmt: skip
    if spec.transpose_out:
        context = context.transpose(1, 2)
        if spec.contiguous_out:
            context = context.contiguous()
    return context, probs
