"""Races a GPU would show in the checked flash kernels, seen in the interpreter.

- Expanded operands: K / V expanded over heads (MQA made GQA-shaped by ``.expand``, stride 0)
  or q, k, v expanded over the batch are read as they are; each gradient is written into its
  own dense buffer. The backward used to write dK / dV with the input's strides, so every
  head's program wrote the same row (dK off by 4.2 against a reference max of 3.9, and which
  head won depended on program order).
- Program order: every output of the forward and the backward (O, LSE, dQ, dK, dV, the
  counters), clean or with an injected fault, is byte for byte that of the in-order run when
  each launch's programs run reversed, in a GPU's order or shuffled
  (:func:`attnchecker.kernels.launches.program_order`). The counters are integer atomics,
  which commute; nothing else is shared between programs.

The tiles are those of an sm_90 fp32 launch (``device_arch`` patched, as ``kernels.aot``
does): 16- and 32-row blocks, so even these short sequences run several programs a head.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from attnchecker.kernels import available, flash
from attnchecker.kernels.flash import KernelFault, flash_backward, flash_forward, new_counts
from attnchecker.kernels.launches import program_order
from attnchecker.kernels.ops import flash_attention, new_sink

from .test_flash_fwd import DEVICE

pytestmark = pytest.mark.skipif(not available(), reason="needs triton (CUDA or the interpreter)")

ATOL = 1e-5  # fp32, as test_flash_bwd: times max(1, the reference's largest gradient)
ORDERS = ("reversed", "gpu", "random")


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture(autouse=True)
def _gpu_tiles():
    if DEVICE != "cpu":  # a GPU's own tiles
        yield
        return
    with mock.patch.object(flash, "device_arch", return_value=90):
        yield


EXPANDED = {  # name: (B, H, Hkv, L, d, expand q over the batch, expand k / v over the batch)
    "kv_over_heads": (1, 4, 1, 32, 16, False, False),  # (1, 1, L, d) -> (1, 4, L, d)
    "qkv_over_batch_gqa": (2, 4, 2, 32, 16, True, True),  # (1, ...) -> (2, ...), GQA 4 / 2
}


@pytest.mark.parametrize("case", EXPANDED)
def test_expanded_operands_get_their_gradients(case):
    """Leaves expanded (stride 0) before the op: autograd sums each gradient over the expanded
    dim, which is right only if the op returns every head's / batch's own gradient."""
    B, H, Hkv, L, d, q_batch, kv_batch = EXPANDED[case]
    heads_kv = H if case == "kv_over_heads" else Hkv
    leaves = (
        _randn(1 if q_batch else B, H, L, d, seed=1),
        _randn(1 if kv_batch else B, Hkv, L, d, seed=2),
        _randn(1 if kv_batch else B, Hkv, L, d, seed=3),
    )
    grad = _randn(B, H, L, d, seed=4)

    def run(attention):
        qq, kk, vv = (t.clone().requires_grad_() for t in leaves)
        q = qq.expand(B, H, L, d)
        k, v = (t.expand(B, heads_kv, L, d) for t in (kk, vv))
        assert 0 in k.stride()  # overlapping: one element seen at several indices
        out = attention(q, k, v)
        out.backward(grad)
        return out.detach(), qq.grad, kk.grad, vv.grad

    counts, sink = new_counts(torch.device(DEVICE)), new_sink(torch.device(DEVICE))
    got = run(lambda q, k, v: flash_attention(q, k, v, causal=True, counts=counts, sink=sink))
    rep = H // heads_kv

    def sdpa(q, k, v):  # on materialised copies
        k, v = (t.contiguous().repeat_interleave(rep, 1) for t in (k, v))
        return F.scaled_dot_product_attention(q.contiguous(), k, v, is_causal=True)

    want = run(sdpa)
    assert counts.sum() == 0 and sink.grad.sum() == 0  # no false alarm
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a - b).abs().max())
        assert err <= ATOL * max(1.0, float(b.abs().max())), (name, err)


def test_gradients_never_alias_their_inputs_strides():
    """flash_backward's gradients are dense: empty_like's layout, the custom op's fake's."""
    B, H, L, d = 1, 4, 32, 16
    q = _randn(B, H, L, d, seed=5)
    k, v = (_randn(B, 1, L, d, seed=s).expand(B, H, L, d) for s in (6, 7))
    out, lse, _ = flash_forward(q, k, v)
    for t, g in zip((q, k, v), flash_backward(q, k, v, out, lse, _randn(B, H, L, d, seed=8)),
                    strict=True):  # fmt: skip
        assert g.is_contiguous() and g.stride() == torch.empty_like(t).stride()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # NaN compares equal to itself here


ST_NAN = KernelFault("st", 0, 3, 30, 7, math.nan, persistent=True)
DQ_LARGE = KernelFault("dq", 0, 0, 40, 2, -3e4, persistent=True)
ORDER_CASES = {  # name: (KernelFault or None, causal, padding, expanded K / V)
    "clean_causal_padding": (None, True, True, False),
    "clean_expanded_kv": (None, False, False, True),
    "s_transient": (KernelFault("s", 0, 2, 20, 9, 7.3e6), True, False, False),
    "dk_transient": (KernelFault("dk", 0, 1, 5, 3, math.inf), True, False, False),
    "st_persistent": (ST_NAN, True, False, False),
    "dq_persistent": (DQ_LARGE, True, False, False),
}


def _forward_backward(case: str) -> dict[str, torch.Tensor]:
    fault, causal, padding, expanded = ORDER_CASES[case]
    B, H, Hkv, L, d = 1, 4, 2, 48, 16
    q = _randn(B, H, L, d, seed=10)
    k, v = (_randn(B, Hkv, L, d, seed=s) for s in (11, 12))
    if expanded:
        k, v = (t[:, :1].expand(B, H, L, d) for t in (k, v))
    key_mask = None
    if padding:
        key_mask = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
        key_mask[0, L - 13 :] = False
    kw = dict(causal=causal, key_mask=key_mask)
    forward = fault is not None and fault.site in flash.FORWARD_SITES
    fwd_counts, bwd_counts = new_counts(q.device), new_counts(q.device)
    grad = _randn(B, H, L, d, seed=13)
    out, lse, _ = flash_forward(q, k, v, fault=fault if forward else None, counts=fwd_counts, **kw)
    dq, dk, dv = flash_backward(
        q, k, v, out, lse, grad, fault=None if forward else fault, counts=bwd_counts, **kw
    )
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, fwd_counts=fwd_counts, bwd_counts=bwd_counts)


SLOW_ORDER_CASES = ("clean_causal_padding", "dk_transient", "st_persistent")
"""In the slow set: the default run keeps the race found, a forward fault and a persistent
backward one."""


@pytest.mark.skipif(DEVICE != "cpu", reason="program orders need the interpreter")
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's inf - inf
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in SLOW_ORDER_CASES else c
                                  for c in ORDER_CASES])  # fmt: skip
def test_outputs_do_not_depend_on_program_order(case):
    want = _forward_backward(case)
    fault = ORDER_CASES[case][0]
    found = want["fwd_counts"] + want["bwd_counts"]
    if fault is None:
        assert found.sum() == 0, found.tolist()
    else:  # the fault is seen: transient corrected, persistent reported
        assert found[:, 0].sum() >= 1 and (found[:, 2].sum() >= 1) == fault.persistent
    for how in ORDERS:
        with program_order(how):
            got = _forward_backward(case)
        differ = [n for n in want if not torch.equal(_bytes(got[n]), _bytes(want[n]))]
        assert not differ, (how, differ)
