"""The SDPA route's backend: the aten attention kernel that ``F.scaled_dot_product_attention`` runs
(a CPU's flash kernel, or its math backend for a dropout call; CUDA's flash kernel, or the
memory-efficient one with a mask), called so that each row's log-sum-exp is at hand, forward
and backward, K / V of fewer heads expanded where the kernel does not take them
(:func:`probe_gqa` decides on the device).

Attention dropout is the kernel's own draw, from the device's generator: a rerun of the whole
call from the generator's state before it (:func:`rng_state`, :func:`rewound`) draws the same
mask (the same seed and offset; the draw follows each head's place in the call, so a sub-batch
of heads would draw another), which the route's repairs rely on; a CPU's backward of a dropout
call reruns its math forward so (:func:`attention_backward`). The checks of what these kernels
return are :mod:`attnchecker.kernels.sdpa_check`'s.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from attnchecker.kernels.launches import as_on_gpu

__all__ = [
    "GQA_NATIVE",
    "attention_backward",
    "attention_forward",
    "backend_mask",
    "dropout_keep",
    "expand_kv",
    "group_sum",
    "probe_gqa",
    "rewound",
    "rng_state",
]

_aten = torch.ops.aten


def expand_kv(t: Tensor, heads: int) -> Tensor:
    """K or V (B, Hkv, Lk, d) -> (B, H, Lk, d) as repeat_kv (head h reads kv head h // rep)."""
    rep = heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def group_sum(t: Tensor, kv_heads: int) -> Tensor:
    """(B, H, ...) -> (B, Hkv, ...): what each query head group contributes to its K/V head."""
    return t.view(t.shape[0], kv_heads, t.shape[1] // kv_heads, *t.shape[2:]).sum(2)


def _native_cpu(q: Tensor) -> bool:
    """Whether the backend is the CPU's flash kernel (GQA native, any mask): on a CPU, unless
    launches are being recorded as on a GPU (:func:`attnchecker.kernels.launches.as_on_gpu`:
    the GPU cost model traces CUDA's path, K / V expanded, on CPU tensors, shapes only)."""
    return q.device.type == "cpu" and not as_on_gpu()


def backend_mask(mask: Tensor | None, q: Tensor) -> Tensor | None:
    """An SDPA mask (4-D, bool: True attends, or additive) as the backend's kernel takes it: an
    additive mask in q's dtype (a bool one as 0 / -inf, as SDPA converts it); on CUDA expanded
    to (B, H, L, Lk) with its last dimension padded to a multiple of 16 and sliced back (the
    memory-efficient kernel's alignment). Views where nothing needs changing."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
    mask = mask.to(q.dtype)
    if _native_cpu(q):
        return mask
    Lk = mask.shape[-1]
    if mask.stride(-1) != 1 or (mask.shape[-2] > 1 and mask.stride(-2) % 16):
        mask = torch.nn.functional.pad(mask, (0, -Lk % 16 or 16))[..., :Lk]  # before expanding
    return mask.expand(*q.shape[:3], Lk)


GQA_NATIVE: dict[str, bool] = {}
"""Whether the flash kernel takes K / V with fewer heads than Q on a device (``str(device)``),
as :func:`probe_gqa` found; where not known, K / V are expanded (two copies forward, two and
two group sums backward at Llama-8B widths: issue 54)."""


def probe_gqa(device: torch.device) -> bool:
    """Run the flash kernel with K / V of fewer heads than Q, forward and backward, on a small
    bf16 case on ``device``, against the same with K / V expanded: whether it takes them and
    agrees (kept in :data:`GQA_NATIVE`). Eager code (the route's self-test calls it)."""
    key = str(device)
    if key not in GQA_NATIVE:
        ok = False
        if torch.device(device).type == "cuda":
            try:
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, n, 64, 64, generator=g).to(device, torch.bfloat16)
                           for n in (4, 2, 2))  # fmt: skip
                grad = torch.randn(1, 4, 64, 64, generator=g).to(device, torch.bfloat16)
                got = _flash(grad, q, k, v)
                want = _flash(grad, q, expand_kv(k, 4), expand_kv(v, 4))
                want = (*want[:2], group_sum(want[2], 2), group_sum(want[3], 2))
                pairs = zip(got, want, strict=True)
                ok = all(a.shape == b.shape and bool(torch.allclose(a.float(), b.float(),
                         rtol=2e-2, atol=2e-2)) for a, b in pairs)  # fmt: skip
            except RuntimeError:
                ok = False
        GQA_NATIVE[key] = ok
    return GQA_NATIVE[key]


def _flash(grad, q, k, v):
    out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=0.125
    )
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=0.125
    )
    return out, dq, dk, dv


def rng_state(device: torch.device | str) -> Tensor:
    """The generator's state on ``device`` (held on the host: no synchronisation), what a
    rerun of a dropout call rewinds to."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextlib.contextmanager
def rewound(state: Tensor | None, device: torch.device):
    """Run the block with ``device``'s generator at ``state`` (None: as it is), then put it
    back where it was: a rerun draws what the first run drew and leaves the stream as it was."""
    if state is None:
        yield
        return
    now = rng_state(device)
    cuda = torch.device(device).type == "cuda"
    setter = (lambda s: torch.cuda.set_rng_state(s, device)) if cuda else torch.set_rng_state
    setter(state)
    try:
        yield
    finally:
        setter(now)


def _math(q, k, v, mask, causal, scale, dropout):
    """SDPA's math backend, as ``F.scaled_dot_product_attention`` runs it on a CPU with dropout
    (its draw from the CPU generator): (out, the dropped probabilities)."""
    return _aten._scaled_dot_product_attention_math(
        q, k, v, backend_mask(mask, q), dropout, causal, scale=scale, enable_gqa=True
    )


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    """The scaled, masked scores (B, H, L, Lk) fp32, products in fp32 under autocast too (the
    math backend's dropout path on a CPU: L x L there, as the backend itself)."""
    L, Lk = q.shape[2], k.shape[2]
    with torch.autocast(q.device.type, enabled=False):
        z = (q.float() @ expand_kv(k, q.shape[1]).float().mT) * scale
    if mask is not None:
        z = z + backend_mask(mask, q).float()
    if causal:
        z = z.masked_fill(torch.ones(L, Lk, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return z


def _lse(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    """Each row's log-sum-exp (B, H, L) fp32: what the math backend does not return."""
    return torch.logsumexp(_scores(q, k, mask, causal, scale), -1)


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
    dropout: float = 0.0,
) -> tuple[Tensor, Tensor, tuple]:  # fmt: skip
    """(out (B, H, L, d), lse (B, H, L) fp32 natural log, what the backward needs) of the
    backend's attention kernel on q (B, H, L, d), k and v (B, Hkv, Lk, d); ``dropout``: the
    kernel's own attention dropout, drawn from the device's generator."""
    if dropout > 0 and q.device.type == "cpu" and not as_on_gpu():  # SDPA's math backend
        return _math(q, k, v, mask, causal, scale, dropout)[0], _lse(q, k, mask, causal, scale), (
            "math",)  # fmt: skip
    if _native_cpu(q):  # GQA native
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=backend_mask(mask, q), scale=scale
        )
        return out, lse, ()
    H, L = q.shape[1], q.shape[2]
    # flash takes no mask, half precision, head sizes to 256, and aligns causality bottom-right
    # (SDPA's is top-left: the same only where L == Lk); the memory-efficient kernel the rest
    square = not causal or k.shape[2] == L
    half = q.dtype in (torch.float16, torch.bfloat16)
    if mask is None and square and half and q.shape[-1] <= 256:
        if not GQA_NATIVE.get(str(q.device), False):
            k, v = expand_kv(k, H), expand_kv(v, H)
        out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, dropout, causal, False, scale=scale
        )
        return out, lse, ("flash", cq, ck, mq, mk, seed, offset)
    k, v = expand_kv(k, H), expand_kv(v, H)
    bias = backend_mask(mask, q)
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, dropout, causal, scale=scale
    )
    return out, lse[..., :L], ("efficient", bias, lse, seed, offset)


def attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    mask: Tensor | None, causal: bool, scale: float, aux: tuple, dropout: float = 0.0,
    rng: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv) of :func:`attention_forward` for the output gradient ``grad``; with
    ``dropout``, the forward's draw: on CUDA the kernel's seed and offset in ``aux``, on a CPU
    the math backend's forward rerun from ``rng`` (the generator's state before it) and
    differentiated in fp32 (:func:`_math_backward`)."""
    if aux and aux[0] == "math":
        return _math_backward(grad, q, k, v, mask, causal, scale, dropout, rng)
    if _native_cpu(q):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=backend_mask(mask, q), scale=scale
        )
    H, Hkv = q.shape[1], k.shape[1]
    if aux[0] == "flash":
        _, cq, ck, mq, mk, seed, offset = aux
        native = GQA_NATIVE.get(str(q.device), False)
        ke, ve = (k, v) if native else (expand_kv(k, H), expand_kv(v, H))
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            grad, q, ke, ve, out, lse, cq, ck, mq, mk, dropout, causal, seed, offset, scale=scale
        )
        if native:  # the kernel summed each group onto its kv head
            return dq, dk, dv
    else:
        _, bias, lse_full, seed, offset = aux
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            grad, q, expand_kv(k, H), expand_kv(v, H), bias, out, lse_full, seed, offset,
            dropout, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
    if Hkv != H:  # the group's gradients summed onto its kv head
        dk, dv = group_sum(dk, Hkv), group_sum(dv, Hkv)
    return dq, dk, dv


def _math_backward(grad, q, k, v, mask, causal, scale, dropout, rng):
    """(dq, dk, dv) of the math backend's dropout call (a CPU's), in fp32 from its draw (rerun
    from ``rng``): P from the scores, W = P Z / (1 - p), dV = W^T dO, dP = Z / (1 - p) o
    (dO V^T), dS = P o (dP - sum_j P dP), dQ = scale dS K, dK = scale dS^T Q (autograd's own
    formulas; explicit, since a registered op's repair runs below autograd)."""
    keep = dropout_keep(q, k, v, mask, causal, scale, dropout, rng).float() / (1 - dropout)
    with torch.autocast(q.device.type, enabled=False):
        return _math_grads(q, k, v, grad, keep, mask, causal, scale)


def _math_grads(q, k, v, grad, keep, mask, causal, scale):
    """:func:`_math_backward`'s formulas, fp32, given the draw ``keep`` (scaled)."""
    H, Hkv = q.shape[1], k.shape[1]
    qf, kf, vf, g = q.float(), expand_kv(k, H).float(), expand_kv(v, H).float(), grad.float()
    p = torch.softmax(_scores(q, k, mask, causal, scale), -1)
    p = p.nan_to_num(0.0)  # a row with no key: 0, as the math backend's
    dv = (p * keep).mT @ g
    dp = (g @ vf.mT) * keep
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq, dk = (ds @ kf) * scale, (ds.mT @ qf) * scale
    if Hkv != H:
        dk, dv = group_sum(dk, Hkv), group_sum(dv, Hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def dropout_keep(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
    dropout: float, rng: Tensor,
) -> Tensor:  # fmt: skip
    """The CPU math backend's dropout draw of a call, (B, H, L, Lk) bool (True: kept; where P is
    0 either way, False), rerun from ``rng``: what emulated faults at the core's sites need (the
    eager S, P, O of a dropout call). CUDA's kernels do not give theirs (there, such a call runs
    the eager engine)."""
    with rewound(rng, q.device):
        return _math(q, k, v, mask, causal, scale, dropout)[1] != 0
