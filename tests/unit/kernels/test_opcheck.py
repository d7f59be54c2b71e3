"""``torch.library.opcheck`` on every registered op of the kernels (in Triton's interpreter
here): the schema's mutations and aliasing match what the kernels do, the fake implementation
gives the real outputs' sizes, strides and dtypes, an op with a gradient registers it through
autograd, and the op traces (functionalised, dynamic shapes) to the eager results.

One row per op: its name and the tiny sample arguments it is checked on. The sample inputs are
those of the ops' own tests (``test_gemm_check``, ``test_projection_check``,
``test_flash_fwd``; the SDPA route's both families, the torch reference's and the Triton
kernels'), with a flagged product where an op repairs, so that the mutations its schema declares
happen. A row restricts ``test_utils`` only with the reason beside it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._library.custom_ops import OPDEFS, CustomOpDef
from torch.library import opcheck

from attnchecker import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
"""opcheck's default test_utils."""


@dataclass(frozen=True)
class Row:
    op: str  # "namespace::name"
    args: Callable[[], tuple]  # builds tiny sample arguments (importing the op's module)
    test_utils: tuple[str, ...] = ALL


# ------------------------------------------------------------------------ the GEMM check's ops


def _gemm(flagged: bool = True):
    """(out, x, y, rec, step, limits) of a small product, one row of out bad where flagged."""
    from .test_gemm_check import _case, _record

    x, y, lim = _case(40, 24, 20, torch.float32, 7)
    out = x @ y
    if flagged:
        out[3, 4] = 1e4
    rec, step = _record()
    return out, x, y, rec, step, lim


def _gemm_refs():
    _out, _x, y, *_ = _gemm(flagged=False)
    return (y,)


def _gemm_verify():
    from attnchecker.kernels.gemm_check import gemm_refs

    out, x, y, rec, step, lim = _gemm()
    f, a, c, cap = lim["floor"], lim["a"], lim["c"], lim["cap"]
    return out, x, gemm_refs(y), None, rec, step, y.numel(), f, a, c, cap


def _gemm_repair():
    from attnchecker.kernels.gemm_check import gemm_refs, gemm_verify

    out, x, y, rec, step, lim = _gemm()
    refs = gemm_refs(y)
    f, a, c, cap = lim["floor"], lim["a"], lim["c"], lim["cap"]
    scr, bits = gemm_verify(out, x, refs, None, rec, step, y.numel(), f, a, c, cap)
    return out, x, y, refs, scr, bits, rec, f, a, c, cap


def _acc_mm():
    from attnchecker.kernels.acc_gemm import terms
    from attnchecker.kernels.gemm_check import gemm_refs

    _out, x, y, rec, step, _lim = _gemm(flagged=False)
    delta = torch.zeros(x.shape[0], y.shape[1])
    delta[3, 4] = 1e4  # one row flagged
    return x, y, torch.randn(y.shape[1]), gemm_refs(y), delta, rec, step, *terms(x, y)


def _gemm_repair_bias():
    *args, lim = _acc_mm_repair_args()
    return (*args, *lim)


def _acc_mm_repair_args():
    """gemm_repair's arguments after a flagged acc_mm with a bias (its delivered limits)."""
    from attnchecker.abft.gemm import limits
    from attnchecker.kernels.acc_gemm import acc_mm

    x, y, b, refs, delta, rec, step, *t = _acc_mm()
    out, scr, bits = acc_mm(x, y, b, refs, delta, rec, step, *t)
    return out, x, y, refs, scr, bits, rec, (*limits(out, x, y, 1.0)[:4], b)


# ------------------------------------------------------------------ the projection check's ops


def _proj():
    """(y, x, weight, bias, ws, site, log, step, limits): a fused Q | K | V (Conv1D layout),
    one element of y bad."""
    from attnchecker.kernels.projection_check import proj_weights

    from .test_projection_check import SITES, G, _case

    x, weight, b, y, lim = _case(torch.float32, conv1d=True, seed=5)
    y[3, 5] = 1e4
    site = list(SITES)
    log, step = torch.zeros(3, 7, dtype=torch.float64), torch.full((1,), 9.0, dtype=torch.float64)
    return y, x, weight, b, proj_weights(weight, b, G, True), site, log, step, lim


def _proj_weights():
    from .test_projection_check import G

    _y, _x, weight, b, *_ = _proj()
    return weight, b, G, True


def _proj_verify():
    y, x, _w, _b, ws, site, log, _step, lim = _proj()
    return y, x, ws, site, log.shape[0], lim["factor"], lim["floor"], lim["absf"], lim["cap"]


def _proj_repair():
    from attnchecker.kernels.projection_check import proj_verify

    y, x, weight, b, ws, site, log, step, lim = _proj()
    f, floor, absf, cap = lim["factor"], lim["floor"], lim["absf"], lim["cap"]
    scr, bits = proj_verify(y, x, ws, site, log.shape[0], f, floor, absf, cap)
    return y, x, weight, b, True, ws, site, scr, bits, log, step, [0, 1, 2], f, floor, absf, cap


# ------------------------------------------------------------------- the flash kernels' ops


def _attention(grad: bool):
    """(q, k, v, key_mask, scale, checks) of a tiny causal GQA call with padding."""
    from attnchecker.kernels.flash import checks_to_mask

    from .test_flash_fwd import _operands

    q, k, v = _operands(1, 2, 1, 16, 16, 16, "fp32")
    key_mask = torch.ones(1, 16, dtype=torch.bool, device=q.device)
    key_mask[:, -3:] = False
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, key_mask, 16**-0.5, checks_to_mask(True)


def _flash_fwd():
    from attnchecker.kernels.ops import new_sink

    q, k, v, key_mask, scale, checks = _attention(grad=True)  # the backward is checked too
    return q, k, v, key_mask, new_sink(q.device), None, None, True, 0, scale, checks, 1.0


def _flash_bwd():
    from attnchecker.kernels.flash import flash_forward

    # the op of a backward, called on tensors that need no gradient (it has no derivative of
    # its own: no double backward), so test_autograd_registration has nothing to check here
    q, k, v, key_mask, scale, checks = _attention(grad=False)
    out, lse, _ = flash_forward(q, k, v, causal=True, key_mask=key_mask, scale=scale)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return q, k, v, out, lse, grad, key_mask, None, True, 0, scale, checks, 1.0


# ------------------------------------------------------------ the SDPA route's checks' ops


def _sdpa(family: str, flagged: bool = True):
    """The SDPA route's check operands of a tiny causal GQA call for ``family`` (the torch
    reference's ops, or the Triton kernels'), the context's element bad where flagged:
    (ops, q, k, v, mask, out, lse, stats, log, step, rowmax, grad, dq, dk, dv, rec)."""
    from attnchecker.kernels import sdpa_check as sc

    ops = sc.REFERENCE
    if family == "triton":
        from attnchecker.kernels import sdpa_kernels_bwd

        ops = sdpa_kernels_bwd.TRITON_OPS
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 24, 16, generator=g) for h in (2, 1, 1))
    out, lse, aux = sc.attention_forward(q, k, v, None, True, 0.25)
    grad = torch.randn(out.shape, generator=g)
    dq, dk, dv = sc.attention_backward(grad, q, k, v, out, lse, None, True, 0.25, aux)
    if flagged:
        out[0, 1, 5, 3] = 1e4
        dk[0, 0, 7, 2] = 1e4
    stats, rowmax = ops.kv_stats(k, v), sc.mask_facts(None, 24)
    log, rec = torch.zeros(2, 7, dtype=torch.float64), torch.zeros(3, 7, dtype=torch.float64)
    step = torch.full((1,), 4.0, dtype=torch.float64)
    return ops, q, k, v, None, out, lse, stats, log, step, rowmax, grad, dq, dk, dv, rec


def _sdpa_rows(family: str) -> list[Row]:
    suffix = "_triton" if family == "triton" else ""

    def kv_stats():
        _ops, _q, k, v, *_ = _sdpa(family, flagged=False)
        return k, v

    def fwd_verify():
        _ops, q, k, _v, _m, out, lse, stats, log, step, rowmax, *_ = _sdpa(family)
        return q, k, out, lse, stats, log, step, [0, 1], 0.25, rowmax, 1.0

    def fwd_repair():
        ops, q, k, v, m, out, lse, stats, log, step, rowmax, *_ = _sdpa(family)
        flags = ops.fwd_verify(q, k, out, lse, stats, log, step, [0, 1], 0.25, rowmax, 1.0)
        return q, k, v, m, out, lse, stats, flags, log, step, [0, 1], True, 0.25, rowmax, 1.0

    def bwd_args():
        _ops, q, k, v, _m, _out, lse, stats, _log, step, rowmax, grad, dq, dk, dv, rec = _sdpa(
            family
        )
        return q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step, [0, 1, 2], 0.25, 1.0

    def bwd_sums():
        *_, dk, dv, _rec = _sdpa(family)
        return dk, dv

    def bwd_repair():
        ops, q, k, v, m, out, lse, stats, _log, step, rowmax, grad, dq, dk, dv, rec = _sdpa(family)
        part, flags = ops.bwd_verify(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step,
                                     [0, 1, 2], 0.25, 1.0)  # fmt: skip
        sums = ops.bwd_sums(dk, dv)
        return (q, k, v, m, out, lse, grad, dq, dk, dv, stats, rowmax, part, flags, sums, rec,
                step, [0, 1, 2], True, 0.25, 1.0)  # fmt: skip

    builders = {"kv_stats": kv_stats, "fwd_verify": fwd_verify, "fwd_repair": fwd_repair,
                "bwd_verify": bwd_args, "bwd_sums": bwd_sums, "bwd_repair": bwd_repair}  # fmt: skip
    return [Row(f"attnchecker::sdpa_{name}{suffix}", fn) for name, fn in builders.items()]


def _sample_rows() -> list[Row]:
    """The SDPA route's sampled-row checks (kernels.sdpa_sample) on the reference's flags."""

    def fwd():
        ops, q, k, v, m, out, lse, stats, log, step, rowmax, *_ = _sdpa("reference")
        flags = ops.fwd_verify(q, k, out, lse, stats, log, step, [0, 1], 0.25, rowmax, 1.0)
        return q, k, v, m, out, lse, flags, log, step, [0, 1], True, 0.25, 1.0, 2, 0, False

    def bwd():
        ops, q, k, v, m, out, lse, stats, _log, step, rowmax, grad, dq, dk, dv, rec = _sdpa(
            "reference"
        )
        _part, flags = ops.bwd_verify(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step,
                                      [0, 1, 2], 0.25, 1.0)  # fmt: skip
        return (q, k, v, m, out, lse, grad, dq, dk, dv, rowmax, flags, rec, step, [0, 1, 2],
                True, 0.25, 1.0, 2, 0)  # fmt: skip

    return [Row("attnchecker::sdpa_fwd_sample", fwd), Row("attnchecker::sdpa_bwd_sample", bwd)]


# ------------------------------------------------- the checks beyond the GEMMs (issue 57)


def _tiny(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def _inv_row_sums():
    a, b, c = _tiny(8, 40, seed=1), _tiny(8, 40, seed=2), _tiny(8, 40, seed=3)
    return (a, b, c, False, True, torch.ones(1, dtype=torch.float64), 1e-8)


def _inv_norm_excess():
    x = _tiny(8, 40) - 0.5
    return (x, x * 2, _tiny(40, seed=4), None, False, False, 1e-6, 1.0)


def _inv_norm_check():
    x = _tiny(8, 40) - 0.5
    return (x, x * 2, _tiny(40, seed=4), None, torch.zeros(4, dtype=torch.float64), False, False,
            1e-6, 1.0)  # fmt: skip


def _checked_adamw():
    coef = torch.tensor([-1e-3, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    return (_tiny(8, 40), _tiny(8, 40, seed=1), _tiny(8, 40, seed=2) * 1e-2,
            _tiny(8, 40, seed=3) * 1e-4, coef, 0.99, 0.9, 0.999, 1e-8)  # fmt: skip


ROWS = [
    Row("attnchecker::inv_row_sums", _inv_row_sums),
    Row("attnchecker::inv_norm_excess", _inv_norm_excess),
    Row("attnchecker::inv_norm_check", _inv_norm_check),
    Row("attnchecker::checked_adamw", _checked_adamw),
    Row("attnchecker::gemm_refs", _gemm_refs),
    Row("attnchecker::gemm_verify", _gemm_verify),
    Row("attnchecker::gemm_repair", _gemm_repair),
    Row("attnchecker::gemm_repair", _gemm_repair_bias),
    Row("attnchecker::acc_mm", _acc_mm),
    Row("attnchecker::proj_weights", _proj_weights),
    Row("attnchecker::proj_verify", _proj_verify),
    Row("attnchecker::proj_repair", _proj_repair),
    Row("attnchecker::flash_fwd", _flash_fwd),
    Row("attnchecker::flash_bwd", _flash_bwd),
    *_sdpa_rows("reference"),
    *_sdpa_rows("triton"),
    *_sample_rows(),
]

MODULES = ("acc_gemm", "gemm_check", "invariants", "projection_check", "ops", "sdpa_check",
           "sdpa_kernels", "sdpa_kernels_bwd", "sdpa_sample")  # fmt: skip
"""The kernels' modules that register ops (importing one registers them)."""


def _registered() -> dict[str, CustomOpDef]:
    """{"attnchecker::name": op} of every op registered, once the modules are imported."""
    for name in MODULES:
        importlib.import_module(f"attnchecker.kernels.{name}")
    return {name: op for name, op in OPDEFS.items() if name.startswith("attnchecker::")}


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.op.split("::")[1])
def test_opcheck(row: Row):
    op = _registered()[row.op]
    opcheck(op, row.args(), test_utils=row.test_utils)


def test_every_registered_op_has_a_row():
    assert set(_registered()) == {row.op for row in ROWS}
