"""The checked flash kernels as PyTorch custom ops, so that a protected model compiles with
``torch.compile(fullgraph=True)``: dynamo sees one opaque op per attention call (with a fake
implementation for shapes) and autograd its registered backward.

Both ops are functional (an op with an autograd formula may not mutate its inputs): the forward
``attnchecker::flash_fwd(q, k, v, key_mask, sink, fault_fwd, fault_bwd, causal, window, scale,
checks, tolerance_scale) -> (out, lse, counts)`` (``checks``: the bit mask of
``kernels.CHECKS`` to run) returns the counters of its checks, which the caller adds to its own;
the backward's counters are returned as the *gradient of* ``sink``, a small float leaf tensor
that requires grad and is otherwise unused, so autograd itself accumulates them into
``sink.grad`` over every layer and step (no mutation, nothing to sync). Faults are encoded
tensors (:meth:`~attnchecker.kernels.flash.KernelFault.encode`): the forward's is injected in
the forward, the backward's saved for the backward. ``torch.library.triton_op`` is not used: on
CPU under compile it touches fake tensors' data.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from attnchecker.abft.cast import autocast_operands
from attnchecker.kernels import CHECKS
from attnchecker.kernels.flash import (
    FORWARD_SITES,
    KernelFault,
    checks_to_mask,
    flash_backward,
    flash_forward,
    mask_to_checks,
    new_counts,
)

__all__ = ["flash_attention", "flash_bwd_op", "flash_fwd_op", "new_sink"]


def new_sink(device: torch.device) -> Tensor:
    """The leaf whose ``.grad`` collects the backward kernels' counters (float32, as
    :func:`~attnchecker.kernels.flash.new_counts`)."""
    return torch.zeros(len(CHECKS), 3, device=device, requires_grad=True)


@torch.library.custom_op("attnchecker::flash_fwd", mutates_args=())
def flash_fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    sink: Tensor,
    fault_fwd: Tensor | None,
    fault_bwd: Tensor | None,
    causal: bool,
    window: int,
    scale: float,
    checks: int,
    tolerance_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    out, lse, counts = flash_forward(
        q, k, v, causal=causal, key_mask=key_mask, window=window, scale=scale, fault=fault_fwd,
        check=mask_to_checks(checks), tolerance_scale=tolerance_scale,
    )  # fmt: skip
    return out, lse, counts


@flash_fwd_op.register_fake
def _(q, k, v, key_mask, sink, fault_fwd, fault_bwd, causal, window, scale, checks, tol):
    B, H, L, _ = q.shape
    counts = q.new_empty(len(CHECKS), 3, dtype=torch.int32)
    return torch.empty_like(q), q.new_empty(B, H, L, dtype=torch.float32), counts


@torch.library.custom_op("attnchecker::flash_bwd", mutates_args=())
def flash_bwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad: Tensor,
    key_mask: Tensor | None,
    fault: Tensor | None,
    causal: bool,
    window: int,
    scale: float,
    checks: int,
    tolerance_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    counts = new_counts(q.device)
    dq, dk, dv = flash_backward(
        q, k, v, out, lse, grad, causal=causal, key_mask=key_mask, window=window, scale=scale,
        counts=counts, fault=fault, check=mask_to_checks(checks), tolerance_scale=tolerance_scale,
    )  # fmt: skip
    return dq, dk, dv, counts.to(torch.float32)


@flash_bwd_op.register_fake
def _(q, k, v, out, lse, grad, key_mask, fault, causal, window, scale, checks, tol):
    counts = q.new_empty(len(CHECKS), 3, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), counts


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, key_mask, _, _, fault_bwd, causal, window, scale, checks, tol = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.extra = (key_mask, fault_bwd, causal, window, scale, checks, tol)


def _backward(ctx, grad_out, grad_lse, grad_counts):
    q, k, v, out, lse = ctx.saved_tensors
    key_mask, fault, causal, window, scale, checks, tol = ctx.extra
    dq, dk, dv, counts = flash_bwd_op(
        q, k, v, out, lse, grad_out, key_mask, fault, causal, window, scale, checks, tol
    )
    return dq, dk, dv, None, counts, None, None, None, None, None, None, None


flash_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _operands(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = autocast_operands(q, k, v)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"q, k and v must share one dtype (or run under autocast): got {q.dtype}, "
            f"{k.dtype}, {v.dtype}"
        )
    return q, k, v


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    counts: Tensor | None = None,
    sink: Tensor | None = None,
    fault: KernelFault | None = None,
    check: bool | Collection[str] = True,
    tolerance_scale: float = 1.0,
) -> Tensor:
    """Differentiable checked flash attention (the custom ops above, so torch.compile traces
    one op): the forward's detections are added to ``counts`` (``flash.new_counts``), the
    backward's accumulate in ``sink.grad`` (:func:`new_sink`). A
    ``fault`` at a backward site is injected in the backward, at a forward site in the
    forward. ``check=False`` runs the kernels without their checks (an unprotected arm), a set
    of :data:`CHECKS` names runs those. The operands are taken as SDPA takes them: under
    autocast fp32 ones are cast to its dtype (a model's RoPE can leave q and k in fp32 while v
    is bf16); otherwise they must share one dtype."""
    q, k, v = _operands(q, k, v)
    code_f = code_b = None
    if fault is not None:
        code = fault.encode(q.shape[1], q.device)
        code_f, code_b = (code, None) if fault.site in FORWARD_SITES else (None, code)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sink = new_sink(q.device) if sink is None else sink
    out, _, found = flash_fwd_op(
        q, k, v, key_mask, sink, code_f, code_b, causal, window, scale, checks_to_mask(check),
        float(tolerance_scale),
    )  # fmt: skip
    if counts is not None:
        counts.add_(found)
    return out
