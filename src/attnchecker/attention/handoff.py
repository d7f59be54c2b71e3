"""What the projection checks hand to the attention core (``mode="passing"``), typed and validated.

The Q/K/V projection checks already hold, per token and head, a bound on the norm of each head's
output, (||x_t|| + 1) ||[W_h | b_h]||_F >= ||y_t,h||_2 (Cauchy-Schwarz), and for V the clean row
sums x_t . (sum_f W_hf) + sum_f b_hf, computed from X and W, not from V. The core may use them
instead of re-reading Q, K and V, but only where they describe the tensors it receives: every part
says which batch, tokens and heads it covers, and :meth:`Handoff.for_core` drops any part that
does not match (a KV cache makes K and V longer than the tokens just projected; a module called
twice, or a cross-attention whose K/V came from a cache, leaves parts that belong to another
call). A dropped part only means the core computes that reference itself: never a crash, never a
false alarm from a stale or partial handoff.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

__all__ = ["CoreInputs", "Handoff", "Part"]


@dataclass(frozen=True)
class Part:
    """Per-token, per-head values of one projection output: (B, L, heads)."""

    bound: Tensor  # >= ||y_t,h||_2
    sums: Tensor  # the clean reference sum_f y_t,h,f

    def covers(self, t: Tensor) -> bool:
        """Whether this part describes t (B, heads, L, d), the layout the core receives."""
        B, L, heads = self.bound.shape
        return t.dim() == 4 and tuple(t.shape[:3]) == (B, heads, L)


@dataclass(frozen=True)
class Handoff:
    """Parts left by the projection checks of one attention call (None: not checked here)."""

    q: Part | None = None
    k: Part | None = None
    v: Part | None = None

    def merge(self, other: Handoff) -> Handoff:
        return dataclasses.replace(self, **{k: v for k, v in vars(other).items() if v is not None})

    def for_core(
        self, query: Tensor, key: Tensor, value: Tensor, norm_scale: float | None
    ) -> CoreInputs:
        """What the core can use for these tensors; ``norm_scale`` is how what sits between the
        projections and the core scales head norms (rotary embeddings: their cos/sin scale; None
        when unknown: the Q/K bounds are then not used)."""
        qk = None
        q, k = self.q, self.k
        if norm_scale is not None and q and k and q.covers(query) and k.covers(key):
            # (B, H, L) and (B, Hkv): the scores bound needs ||q_i|| and sum_j ||k_j||
            qk = (
                q.bound.transpose(1, 2) * norm_scale,
                k.bound.sum(1) * norm_scale,
            )
        v_rows = None
        if self.v is not None and self.v.covers(value):
            d = value.shape[-1]
            v_rows = (self.v.sums.transpose(1, 2), self.v.bound.transpose(1, 2) * d**0.5)
        return CoreInputs(qk, v_rows)


@dataclass(frozen=True)
class CoreInputs:
    """The validated parts, in the core's layout, before K/V heads are repeated."""

    qk_norms: tuple[Tensor, Tensor] | None  # (B, H, L) >= ||q_i||, (B, Hkv) >= sum_j ||k_j||
    v_rows: tuple[Tensor, Tensor] | None  # (B, Hkv, Lk): sum_f v_jf, >= sum_f |v_jf|
