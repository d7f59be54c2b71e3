"""Attention masks, converted between the forms the entries receive and the engines take, in one
place.

The forms:

- **eager**: additive, in the query's dtype, ``finfo.min`` where a key is excluded (the eager
  core's, and transformers' eager mask: a row with no key gives uniform probabilities where SDPA
  gives NaN, as transformers' eager attention does);
- **sdpa**: SDPA's ``attn_mask`` (a boolean True attends, or additive; 2-D to 4-D, broadcast)
  with ``is_causal`` aligned top-left;
- **keys**: a (B, Lk) key mask (True or 1 attends: padding) with causality aligned bottom-right
  (query i at key Lk - L + i) and a sliding window: the fused kernels', transformers'
  flash-attention mask;
- **bias**: the fp32 additive form of an SDPA mask, -inf where excluded (the SDPA route's
  emulated sites compute S, P and O from it).

(The backend's own kernels take theirs from :func:`attnchecker.kernels.sdpa_backend.backend_mask`,
with the padding the memory-efficient kernel needs.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnchecker.kernels.constants import device_constant

__all__ = ["bias_from_sdpa", "eager_from_keys", "eager_from_sdpa", "keys_from_sdpa", "masked_out",
           "sdpa_4d"]  # fmt: skip


def masked_out(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A mask whose boolean True masks out (``nn.MultiheadAttention``'s; ``~`` an SDPA one) in
    the eager form; an additive mask as it is, in ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask, torch.finfo(dtype).min
    )


def eager_from_keys(
    key_mask: Tensor | None, L: int, Lk: int, *, causal: bool, window: int, dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:  # fmt: skip
    """The keys form (causal bottom-right, a window, a (B, Lk) key mask or None) in the eager
    form, (B or 1, 1, L, Lk)."""
    if key_mask is None and not causal and not window:
        return None
    i = torch.arange(L, device=device)[:, None] + (Lk - L)
    j = torch.arange(Lk, device=device)[None, :]
    ok = torch.ones(L, Lk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    ok = ok[None, None]
    if key_mask is not None:
        ok = ok & key_mask.bool()[:, None, None, :]
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(ok, zero, torch.finfo(dtype).min)


def eager_from_sdpa(
    attn_mask: Tensor | None, causal: bool, L: int, Lk: int, dtype: torch.dtype, device
) -> Tensor | None:
    """The sdpa form in the eager form; the causal one made once per shape (a graph constant
    under torch.compile), not two L x L tensors per call."""
    if not causal:
        if attn_mask is None or attn_mask.dtype != torch.bool:
            return attn_mask
        return masked_out(~attn_mask, dtype)
    return device_constant(("causal", L, Lk, dtype), device, lambda: masked_out(
        ~torch.ones(L, Lk, dtype=torch.bool, device=device).tril(), dtype))  # fmt: skip


def sdpa_4d(attn_mask: Tensor | None) -> Tensor | None:
    """An SDPA mask as 4-D (SDPA broadcasts (L, Lk) and (B | 1, L, Lk)): a view."""
    if attn_mask is None or attn_mask.dim() >= 4:
        return attn_mask
    return attn_mask.view(*(1,) * (4 - attn_mask.dim()), *attn_mask.shape)


def keys_from_sdpa(attn_mask: Tensor | None, B: int, Lk: int) -> tuple[Tensor | None, str | None]:
    """An SDPA mask in the keys form, a (B, Lk) boolean key mask (True attends), or why it is not
    one (then the checked eager core runs the call)."""
    if attn_mask is None:
        return None, None
    if attn_mask.dtype != torch.bool:
        return None, "an additive float attn_mask (the kernels take a boolean key mask)"
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
        return None, "an attn_mask per query (the kernels take a mask per key)"
    return attn_mask.reshape(attn_mask.shape[0], Lk).expand(B, Lk), None


def bias_from_sdpa(mask: Tensor | None, causal: bool, L: int, Lk: int, device) -> Tensor | float:
    """The sdpa form (4-D mask or None; causal top-left, as SDPA's) as an fp32 additive bias, 0
    where attended and -inf elsewhere."""
    bias: Tensor | float = 0.0
    if causal:
        bias = torch.ones(L, Lk, dtype=torch.bool, device=device).tril().logical_not()
        bias = torch.zeros(L, Lk, device=device).masked_fill(bias, -math.inf)
    if mask is not None:
        m = mask.float() if mask.dtype != torch.bool else torch.zeros(
            (), device=device).masked_fill(~mask, -math.inf)  # fmt: skip
        bias = bias + m
    return bias
