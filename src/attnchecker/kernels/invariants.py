"""The checks beyond the GEMMs as Triton kernels, each beside its eager reference: one pass over
the data a check reads, one launch.

- :func:`row_sums` (reference :func:`attnchecker.abft.update.row_sums`): the update check's row
  sums ``[sum x, sum (j + 1) x, sum |x|]`` of one to three tensors of one shape, and with
  ``adam`` also of ``r = m / (sqrt(v) / root + eps)`` from the new moments (m, v the second and
  third tensors), accumulated in fp64, a program a tile of rows (~2,048 elements a step).
  ``square`` adds the sums of the first tensor's squares (a gradient's, for Adam's v). One
  launch reads each element once: the gradients before the step (4 bytes a parameter in fp32),
  the parameters and moments after it (12): what the check adds to an AdamW step that reads and
  writes 28.
- :func:`norm_excess` (reference :func:`attnchecker.abft.norm.row_excess`): per row of a norm
  module's output, how far its worst element exceeds the rounding bound against the row
  recomputed from the input, a program a row, one read of x and y; :func:`inv_norm_check`, the
  same launch repairing a flagged row with its reference and counting it in the module's record
  (the clean path writes nothing: one launch a norm call).

Used where a tensor is on CUDA, and in Triton's interpreter on a CPU when the config asks for
the kernels (``check_impl="triton"``: the tests, the launch counts); else the references run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.kernels import available, interpreting

__all__ = ["inv_norm_check", "inv_norm_excess", "inv_row_sums", "norm_excess", "row_sums",
           "use_kernels"]


def use_kernels(t: Tensor, asked: bool) -> bool:
    """Whether the kernels run for ``t``: on CUDA, or in the interpreter when ``asked``."""
    return available() and (t.is_cuda or (asked and interpreting()))


@triton.jit
def _sums(acc_s, acc_w, acc_a, x, j):
    return acc_s + tl.sum(x, 1), acc_w + tl.sum(x * j, 1), acc_a + tl.sum(tl.abs(x), 1)


@triton.jit
def _put(OUT, rows, rmask, i: tl.constexpr, s, w, a):
    tl.store(OUT + rows * 12 + 3 * i, s, mask=rmask)
    tl.store(OUT + rows * 12 + 3 * i + 1, w, mask=rmask)
    tl.store(OUT + rows * 12 + 3 * i + 2, a, mask=rmask)


@triton.jit
def row_sums_kernel(A, B, C, OUT, n_rows, n_cols, ROOT, eps, N: tl.constexpr,
                    SQUARE: tl.constexpr, ADAM: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    z = tl.zeros((ROWS,), dtype=tl.float64)
    root = tl.load(ROOT)  # sqrt(bc2), on the device (a fused optimizer's step count is there)
    s0, w0, a0, s1, w1, a1, s2, w2, a2, s3, w3, a3 = z, z, z, z, z, z, z, z, z, z, z, z
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        at = rows[:, None] * n_cols + cols[None, :]
        j = (cols + 1).to(tl.float64)[None, :]
        a = tl.load(A + at, mask=mask, other=0.0).to(tl.float64)
        s0, w0, a0 = _sums(s0, w0, a0, a, j)
        if SQUARE:
            s1, w1, a1 = _sums(s1, w1, a1, a * a, j)
        if N > 1:
            b = tl.load(B + at, mask=mask, other=0.0).to(tl.float64)
            s1, w1, a1 = _sums(s1, w1, a1, b, j)
        if N > 2:
            c = tl.load(C + at, mask=mask, other=0.0).to(tl.float64)
            s2, w2, a2 = _sums(s2, w2, a2, c, j)
            if ADAM:
                r = tl.where(mask, b / (tl.sqrt(c) / root + eps), 0.0)
                s3, w3, a3 = _sums(s3, w3, a3, r, j)
    _put(OUT, rows, rmask, 0, s0, w0, a0)
    _put(OUT, rows, rmask, 1, s1, w1, a1)
    _put(OUT, rows, rmask, 2, s2, w2, a2)
    _put(OUT, rows, rmask, 3, s3, w3, a3)


def row_sums(*tensors: Tensor, square: bool = False, adam: tuple[float, float] | None = None,
             kernel: bool = False) -> list[Tensor]:  # fmt: skip
    """Each tensor's (rows, 3) float64 row sums (:func:`attnchecker.abft.update.row_sums`),
    then, with ``square``, the first tensor's squares', and with ``adam=(root, eps)`` (three
    tensors: parameter, m, v) those of ``m / (sqrt(v) / root + eps)``; in one launch when
    ``kernel``, else by the reference."""
    from attnchecker.abft.update import as_rows
    from attnchecker.abft.update import row_sums as reference

    if not kernel:
        out = [reference(t) for t in tensors]
        if square:
            out.append(reference(tensors[0].double() ** 2))
        if adam is not None:
            root, eps = adam
            m, v = tensors[1].double(), tensors[2].double()
            out.append(reference(m / (v.sqrt() / root + eps)))
        return out
    rows = [as_rows(t.detach()).contiguous() for t in tensors]
    b, c = [*rows[1:], None, None][:2]
    if square and len(rows) > 1:
        raise ValueError("square takes one tensor")
    root, eps = adam if adam is not None else (_one(rows[0].device), 0.0)
    root = torch.as_tensor(root, dtype=torch.float64).reshape(1).to(rows[0].device)
    out = inv_row_sums(rows[0], b, c, square, adam is not None, root, float(eps))
    k = len(rows) + int(square) + int(adam is not None)
    return [out[:, i] for i in range(k)]


_ONES: dict[torch.device, Tensor] = {}


def _one(device: torch.device) -> Tensor:
    """A float64 1.0 on ``device``, made once (no host-to-device copy a call)."""
    if device not in _ONES:
        _ONES[device] = torch.ones(1, dtype=torch.float64, device=device)
    return _ONES[device]


@torch.library.custom_op("attnchecker::inv_row_sums", mutates_args=())
def inv_row_sums(a: Tensor, b: Tensor | None, c: Tensor | None, square: bool, adam: bool,
                 root: Tensor, eps: float) -> Tensor:  # fmt: skip
    """One launch of :func:`row_sums_kernel` over (rows, cols) tensors: (rows, 4, 3) fp64."""
    n_rows, n_cols = a.shape
    out = torch.empty(n_rows, 4, 3, dtype=torch.float64, device=a.device)
    n = 1 + (b is not None) + (c is not None)
    block = min(triton.next_power_of_2(max(n_cols, 16)), 512)
    per = max(1, min(64, 2048 // block))  # rows a program: ~2,048 elements a tile
    row_sums_kernel[(triton.cdiv(n_rows, per),)](
        a, a if b is None else b, a if c is None else c, out, n_rows, n_cols, root, eps, N=n,
        SQUARE=square, ADAM=adam, ROWS=per, BLOCK=block,
    )  # fmt: skip
    return out


@inv_row_sums.register_fake
def _(a, b, c, square, adam, root, eps):
    return a.new_empty(a.shape[0], 4, 3, dtype=torch.float64)


@triton.jit
def norm_excess_kernel(X, Y, W, B, OUT, REC, n_cols, eps, u_out, scale, spacing,
                       LAYER: tl.constexpr, HAS_W: tl.constexpr, OFFSET: tl.constexpr,
                       HAS_B: tl.constexpr, REPAIR: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    base = row.to(tl.int64) * n_cols
    h = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
    got = tl.load(Y + base + cols, mask=mask, other=0.0).to(tl.float32)
    mean_abs = 0.0
    if LAYER:
        mu = tl.sum(h, 0) / n_cols
        c = tl.where(mask, h - mu, 0.0)
        mean_abs = tl.sum(tl.abs(h), 0) / n_cols
    else:
        c = h
    rs = 1.0 / tl.sqrt(tl.sum(c * c, 0) / n_cols + eps)
    g = 1.0
    floor = 2 * spacing
    if HAS_W:
        g = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        floor = 2 * spacing * (tl.abs(g) + 1.0)
        if OFFSET:
            g = g + 1.0
    ref = g * (c * rs)
    b = 0.0
    if HAS_B:
        bias = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        ref = ref + bias
        b = tl.abs(bias)
    spread = tl.abs(c) + tl.abs(h) + mean_abs
    bound = (n_cols + 4) * 5.960464477539063e-08 * tl.abs(g) * rs * spread
    got_abs = tl.where(got == got, tl.abs(got), 0.0)
    got_abs = tl.where(got_abs < float("inf"), got_abs, 0.0)
    tol = scale * (2 * u_out * (got_abs + tl.abs(ref) + b) + bound + floor)
    err = tl.abs(got - ref)
    err = tl.where(err == err, err, float("inf"))  # NaN: as far as it gets
    exc = tl.max(tl.where(mask, err - tol, -float("inf")), 0)
    if REPAIR:  # a flagged row gets its reference; the record counts it (the clean path: no write)
        if exc > 0:
            tl.store(Y + base + cols, ref.to(Y.dtype.element_ty), mask=mask)
            big = tl.abs(got)
            code = tl.where(got != got, 3.0, tl.where(big == float("inf"), 2.0,
                                                      tl.where(big >= 1e10, 1.0, 0.0)))
            tl.atomic_max(REC, 1.0)
            tl.atomic_add(REC + 1, 1.0)
            tl.atomic_max(REC + 3, tl.max(tl.where(mask, code, 0.0), 0).to(tl.float64))
    else:
        tl.store(OUT + row.to(tl.int64), exc)


def norm_excess(spec, x: Tensor, y: Tensor, weight: Tensor | None, bias: Tensor | None, *,
                scale: float = 1.0, kernel: bool = False) -> Tensor:  # fmt: skip
    """Per row of ``y`` (rows, d), the excess of its worst element over the rounding bound
    (:func:`attnchecker.abft.norm.row_excess`'s first result), in one launch when ``kernel``."""
    from attnchecker.abft.norm import row_excess

    if not kernel:
        return row_excess(spec, x, y, weight, bias, scale=scale)[0]
    d = y.shape[-1]
    x2, y2 = x.detach().reshape(-1, d).contiguous(), y.detach().reshape(-1, d)
    w = None if weight is None else weight.detach()
    b = None if bias is None else bias.detach()
    return inv_norm_excess(x2, y2, w, b, spec.kind == "layer", spec.offset, float(spec.eps),
                           float(scale))  # fmt: skip


@torch.library.custom_op("attnchecker::inv_norm_excess", mutates_args=())
def inv_norm_excess(x: Tensor, y: Tensor, w: Tensor | None, b: Tensor | None, layer: bool,
                    offset: bool, eps: float, scale: float) -> Tensor:  # fmt: skip
    """One launch of :func:`norm_excess_kernel` over (rows, d) x and y: (rows,) fp32."""
    out = torch.empty(y.shape[0], dtype=torch.float32, device=y.device)
    _launch(x, y, w, b, out, out, layer, offset, eps, scale, repair=False)
    return out


@inv_norm_excess.register_fake
def _(x, y, w, b, layer, offset, eps, scale):
    return y.new_empty(y.shape[0], dtype=torch.float32)


@torch.library.custom_op("attnchecker::inv_norm_check", mutates_args=("y", "rec"))
def inv_norm_check(x: Tensor, y: Tensor, w: Tensor | None, b: Tensor | None, rec: Tensor,
                   layer: bool, offset: bool, eps: float, scale: float) -> None:  # fmt: skip
    """The norm check and its repair in one launch over (rows, d) x and y: a flagged row is
    overwritten with its fp32 reference in y's dtype (within the bound of the module's own
    value), and ``rec`` (float64 ``[calls, rows, 0, kind code]``) counts it; the clean path
    writes nothing."""
    _launch(x, y, w, b, rec, rec, layer, offset, eps, scale, repair=True)


@inv_norm_check.register_fake
def _(x, y, w, b, rec, layer, offset, eps, scale):
    return None


def _launch(x, y, w, b, out, rec, layer, offset, eps, scale, *, repair: bool) -> None:
    u_out = max(torch.finfo(t.dtype).eps / 2 for t in (x, y))
    spacing = max(torch.finfo(t.dtype).tiny * torch.finfo(t.dtype).eps for t in (x, y))
    norm_excess_kernel[(y.shape[0],)](
        x, y, x if w is None else w, x if b is None else b, out, rec, y.shape[1], eps, u_out,
        scale, spacing, LAYER=layer, HAS_W=w is not None, OFFSET=offset, HAS_B=b is not None,
        REPAIR=repair, BLOCK=triton.next_power_of_2(y.shape[1]),
    )  # fmt: skip


@triton.jit
def checked_adamw_kernel(P, G, M, V, OUT, COEF, n_rows, n_cols, decay, b1, b2, eps,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """AdamW's update of one parameter tensor (rows x cols, fp32 math), and in the same pass
    the row sums the update check compares (module docstring): of the gradient, its square, the
    new parameter, moments and ``r = m' / (sqrt(v') / sqrt(bc2) + eps)``. ``COEF`` (fp64, on
    the device): ``[-lr / bc1, 1 / sqrt(bc2), skip, 1 / grad scale, sign]``; a skipped step
    writes the values it read."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    k = tl.arange(0, 8).to(tl.int64)
    coef = tl.load(COEF + k, mask=k < 5, other=0.0)
    step_size = tl.sum(tl.where(k == 0, coef, 0.0), 0).to(tl.float32)
    inv_root = tl.sum(tl.where(k == 1, coef, 0.0), 0).to(tl.float32)
    skip = tl.sum(tl.where(k == 2, coef, 0.0), 0) > 0
    inv_scale = tl.sum(tl.where(k == 3, coef, 0.0), 0).to(tl.float32)
    sign = tl.sum(tl.where(k == 4, coef, 0.0), 0).to(tl.float32)
    z = tl.zeros((ROWS,), dtype=tl.float64)
    s0, w0, a0, s1, w1, a1, s2, w2, a2, s3, w3, a3 = z, z, z, z, z, z, z, z, z, z, z, z
    s4, w4, a4, s5, w5, a5 = z, z, z, z, z, z
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        at = rows[:, None] * n_cols + cols[None, :]
        j = (cols + 1).to(tl.float64)[None, :]
        p = tl.load(P + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32) * inv_scale * sign
        m = tl.load(M + at, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + at, mask=mask, other=0.0).to(tl.float32)
        m2 = m + (1.0 - b1) * (g - m)  # torch's lerp
        v2 = v * b2 + (1.0 - b2) * g * g
        denom = tl.sqrt(v2) * inv_root + eps
        p2 = p * decay + step_size * (m2 / denom)
        m2 = tl.where(skip, m, m2)
        v2 = tl.where(skip, v, v2)
        p2 = tl.where(skip, p, p2)
        r = tl.where(mask, m2 / (tl.sqrt(v2) * inv_root + eps), 0.0)
        tl.store(P + at, p2.to(P.dtype.element_ty), mask=mask)
        tl.store(M + at, m2.to(M.dtype.element_ty), mask=mask)
        tl.store(V + at, v2.to(V.dtype.element_ty), mask=mask)
        g64 = g.to(tl.float64)
        s0, w0, a0 = _sums(s0, w0, a0, g64, j)
        s1, w1, a1 = _sums(s1, w1, a1, g64 * g64, j)
        # the sums of what was stored (rounded to the tensors' dtype), as a later pass reads it
        s2, w2, a2 = _sums(s2, w2, a2, p2.to(P.dtype.element_ty).to(tl.float64), j)
        s3, w3, a3 = _sums(s3, w3, a3, m2.to(M.dtype.element_ty).to(tl.float64), j)
        s4, w4, a4 = _sums(s4, w4, a4, v2.to(V.dtype.element_ty).to(tl.float64), j)
        s5, w5, a5 = _sums(s5, w5, a5, r.to(tl.float64), j)
    out = OUT
    tl.store(out + rows * 18 + 0, s0, mask=rmask)
    tl.store(out + rows * 18 + 1, w0, mask=rmask)
    tl.store(out + rows * 18 + 2, a0, mask=rmask)
    tl.store(out + rows * 18 + 3, s1, mask=rmask)
    tl.store(out + rows * 18 + 4, w1, mask=rmask)
    tl.store(out + rows * 18 + 5, a1, mask=rmask)
    tl.store(out + rows * 18 + 6, s2, mask=rmask)
    tl.store(out + rows * 18 + 7, w2, mask=rmask)
    tl.store(out + rows * 18 + 8, a2, mask=rmask)
    tl.store(out + rows * 18 + 9, s3, mask=rmask)
    tl.store(out + rows * 18 + 10, w3, mask=rmask)
    tl.store(out + rows * 18 + 11, a3, mask=rmask)
    tl.store(out + rows * 18 + 12, s4, mask=rmask)
    tl.store(out + rows * 18 + 13, w4, mask=rmask)
    tl.store(out + rows * 18 + 14, a4, mask=rmask)
    tl.store(out + rows * 18 + 15, s5, mask=rmask)
    tl.store(out + rows * 18 + 16, w5, mask=rmask)
    tl.store(out + rows * 18 + 17, a5, mask=rmask)


@torch.library.custom_op("attnchecker::checked_adamw", mutates_args=("p", "m", "v"))
def checked_adamw(p: Tensor, g: Tensor, m: Tensor, v: Tensor, coef: Tensor, decay: float,
                  b1: float, b2: float, eps: float) -> Tensor:  # fmt: skip
    """AdamW's step of one (rows, cols) parameter with its row sums, one launch: (rows, 6, 3)
    fp64, the sums of g, g^2, p', m', v', r (:func:`checked_adamw_kernel`)."""
    n_rows, n_cols = p.shape
    out = torch.empty(n_rows, 6, 3, dtype=torch.float64, device=p.device)
    block = min(triton.next_power_of_2(max(n_cols, 16)), 256)
    per = max(1, min(64, 512 // block))  # ~512 elements a tile: 18 fp64 sums stay in registers
    checked_adamw_kernel[(triton.cdiv(n_rows, per),)](
        p, g, m, v, out, coef, n_rows, n_cols, decay, b1, b2, eps, ROWS=per, BLOCK=block,
        num_warps=4,
    )  # fmt: skip
    return out


@checked_adamw.register_fake
def _(p, g, m, v, coef, decay, b1, b2, eps):
    return p.new_empty(p.shape[0], 6, 3, dtype=torch.float64)
