"""What the projection checks hand to the attention core (``mode="passing"``), typed and validated.

The V projection check computes, per token and head, the clean row sums of V from X and W
(x_t . sum_f W_hf + sum_f b_hf), before V is read by anyone: they are the reference the context
check needs (sum_f c_if = sum_j p_ij sum_f v_jf), and taking them from upstream also covers V
between the projection and the core. The core uses them only where they describe the tensor it
receives: a part says which batch, tokens and heads it covers, and :meth:`Handoff.for_core`
drops it on any mismatch (a KV cache makes V longer than the tokens just projected; a module
called twice, or a cross-attention whose V came from a cache, leaves a part that belongs to
another call). A dropped part only means the core sums V itself: never a crash, never a false
alarm from a stale or partial handoff.

The projection checks also hold bounds on the norms of Q and K per head, (||x_t|| + 1)
||[W_h | b_h]||_F, but they are measured to be about 500x looser than ||q_i|| sum_j ||k_j|| from
the operands (``benchmarks/check_sensitivity.py``: passing them made the scores check blind to
errors below 30% of a row's L1 norm in fp32), while the core computes those norms in three ops:
they are not handed over.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Handoff"]


@dataclass(frozen=True)
class Handoff:
    """V's clean row sums (B, L, heads) from the V projection check of one attention call, and
    the bound on how far the delivered V's row sums may be from them (the projection check's
    own tolerance: GEMM rounding, and under autocast the rounding of X and W to bf16)."""

    v_sums: Tensor
    v_err: Tensor

    def for_core(self, value: Tensor) -> tuple[Tensor, Tensor] | None:
        """(sums, err) in the core's layout (B, heads, L) when they describe ``value`` (B, heads,
        L, d) as the core receives it (before K/V heads are repeated), else None."""
        B, L, heads = self.v_sums.shape
        if value.dim() != 4 or tuple(value.shape[:3]) != (B, heads, L):
            return None
        return self.v_sums.transpose(1, 2), self.v_err.transpose(1, 2)
