"""The normalisations' checks (``ABFTConfig(invariants=("norm",))``): a forward hook on each of
the model's own RMSNorm / LayerNorm modules compares every output element with the row
recomputed from the module's input (:mod:`attnchecker.abft.norm`: a per-element rounding bound)
and repairs the worst ``max_rows`` flagged rows on the device, by the module's own forward on
those rows (exact: the same code on the same inputs), without a host read. More flagged rows than
that are recorded as lost (uncorrectable: the policy decides). The hook reads the input and the
output once; what it costs is in ``docs/invariants.md``.

A norm module is an ``nn.LayerNorm``, an ``nn.RMSNorm`` or a module whose class name ends in
``RMSNorm`` / ``LayerNorm`` (every family of the table: Llama's, Gemma's ``1 + weight``, T5's);
what it computes is read from its attributes and confirmed on a probe row, so a norm that
computes something else (a scale, a different order) is named unchecked, with the reason, in
``summary()["invariants"]`` and a warning, never checked against the wrong formula.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnchecker.abft.norm import NormSpec, row_excess
from attnchecker.kernels.invariants import inv_norm_check, norm_excess, use_kernels

__all__ = ["NormCheck", "find_norms", "spec_of"]

_NAME = re.compile(r"(RMSNorm|LayerNorm)$")
_LAYER = re.compile(r"\.(\d+)\.")
_KINDS = ("finite", "near_inf", "inf", "nan")  # a record's kind code: the worst value's


def _eps(m: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, name, None)
        if isinstance(v, float | int):
            return float(v)
    return None


def spec_of(m: nn.Module) -> tuple[NormSpec | None, str]:
    """``(spec, "")`` for a normalisation this check recomputes exactly, else ``(None, why)``."""
    weight = getattr(m, "weight", None)
    if isinstance(m, nn.LayerNorm | nn.RMSNorm):
        if len(m.normalized_shape) != 1:
            return None, f"normalises over {len(m.normalized_shape)} dims (the check: the last)"
        kind = "layer" if isinstance(m, nn.LayerNorm) else "rms"
        eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
        offsets: tuple[bool, ...] = (False,)
    else:
        eps = _eps(m)
        if eps is None:
            return None, "no eps attribute (variance_epsilon / eps) to recompute it with"
        kind = "rms" if type(m).__name__.endswith("RMSNorm") else "layer"
        offsets = (False, True)
    if not isinstance(weight, Tensor) or weight.is_meta:  # nothing to probe with (a meta model:
        # torchtitan's, or no weight): what the class says
        return NormSpec(kind, float(eps), offset=type(m).__name__.startswith("Gemma")), ""
    for offset in offsets:
        spec = NormSpec(kind, float(eps), offset)
        if _probe(m, spec):
            return spec, ""
    return None, f"its output is not the {kind} normalisation the check recomputes (probed)"


def _probe(m: nn.Module, spec: NormSpec) -> bool:
    weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
    d = weight.shape[-1] if isinstance(weight, Tensor) else None
    if d is None:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, d, generator=g).to(weight.device, weight.dtype)
    kept = weight.detach().clone()
    try:  # a weight of its own for the probe: ones (a fresh model) would make w and 1 + w alike
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=g))
            y = m.forward(x)
        if not isinstance(y, Tensor) or y.shape != x.shape:
            return False
        excess, _ = row_excess(spec, x, y, weight, bias if isinstance(bias, Tensor) else None)
        return bool((excess <= 0).all())
    finally:
        with torch.no_grad():
            weight.copy_(kept)


def find_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's normalisation modules, by qualified name."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.LayerNorm | nn.RMSNorm) or _NAME.search(type(m).__name__)
    ]


@dataclass
class _Norm:
    name: str
    module: nn.Module
    spec: NormSpec
    layer: int


class NormCheck:
    """The hooks on a model's norm modules and their records: per module a float64 row
    ``[calls flagged, rows flagged, rows lost, kind code]`` (:data:`_KINDS`: the worst
    delivered value's), on the device. On the kernels (CUDA; ``check_impl="triton"`` in the
    interpreter) one launch a call checks, repairs every flagged row with its fp32 reference
    (within the check's bound of the module's own value) and records; else the eager reference
    repairs the worst ``max_rows`` rows by the module's own forward (exact)."""

    op = "norm"

    def __init__(self, model: nn.Module, *, max_rows: int, scale: float, device: torch.device,
                 kernels: bool = False):  # fmt: skip
        self.max_rows, self.scale = max_rows, scale
        self.kernels = kernels  # the Triton kernel in the interpreter too (check_impl="triton")
        self.norms: list[_Norm] = []
        self.unchecked: dict[str, str] = {}
        self.undo: list[Callable[[], None]] = []
        for name, m in find_norms(model):
            spec, why = spec_of(m)
            if spec is None:
                self.unchecked[name] = why
                continue
            found = _LAYER.search("." + name + ".")
            self.norms.append(_Norm(name, m, spec, int(found.group(1)) if found else -1))
        self.records = torch.zeros(len(self.norms), 4, dtype=torch.float64, device=device)
        self.enabled = True
        for i, n in enumerate(self.norms):
            hook = n.module.register_forward_hook(self._hook(i), with_kwargs=True)
            self.undo.append(hook.remove)

    def _hook(self, i: int):
        def check(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            if not self.enabled or not isinstance(output, Tensor) or not isinstance(x, Tensor):
                return
            self._check(i, module, x, output)

        return check

    def _check(self, i: int, module: nn.Module, x: Tensor, y: Tensor) -> None:
        n = self.norms[i]
        if y.shape != x.shape or not y.is_contiguous() or y.numel() == 0 or y.is_meta:
            return
        bias = getattr(module, "bias", None)
        weight = getattr(module, "weight", None)
        weight = weight.detach() if isinstance(weight, Tensor) else None
        bias = bias.detach() if isinstance(bias, Tensor) else None
        if use_kernels(y, self.kernels):  # one launch: check, repair, record
            d = y.shape[-1]
            inv_norm_check(x.detach().reshape(-1, d).contiguous(), y.detach().view(-1, d),
                           weight, bias, self.records[i], n.spec.kind == "layer",
                           n.spec.offset, float(n.spec.eps), float(self.scale))  # fmt: skip
            return
        excess = norm_excess(
            n.spec, x, y, weight, bias, scale=self.scale
        ).reshape(-1)  # fmt: skip
        d = y.shape[-1]
        bad = excess > 0  # (rows,)
        k = min(self.max_rows, excess.numel())
        worst = torch.topk(excess.nan_to_num(float("inf")), k).indices  # (k,)
        with torch.no_grad():
            x2 = x.detach().reshape(-1, d)
            y2 = y.detach().view(-1, d)
            # the worst row's largest delivered value (the event's kind: an extreme error is it;
            # tensor indices only: a 0-dim index would be read on the host)
            top = y2.index_select(0, worst[:1]).float().reshape(-1)
            value = top.gather(0, top.abs().nan_to_num(float("inf")).argmax().reshape(1))
            v = value.double().reshape(())
            code = torch.where(v != v, 3.0, torch.where(v.abs() == float("inf"), 2.0,
                               torch.where(v.abs() >= 1e10, 1.0, 0.0))).double()  # fmt: skip
            fixed = module.forward(x2.index_select(0, worst)).to(y.dtype)  # its own math
            keep = y2.index_select(0, worst)
            y2.index_copy_(0, worst, torch.where(bad.index_select(0, worst).unsqueeze(-1),
                                                 fixed, keep))  # fmt: skip
            flagged = bad.sum()
            row = torch.stack([
                (flagged > 0).double(), flagged.double(), (flagged - k).clamp(min=0).double(),
            ])  # fmt: skip
            rec = self.records[i]
            rec[:3].add_(row.to(rec.device))
            rec[3].copy_(torch.maximum(rec[3], torch.where(flagged > 0, code, 0.0).to(rec.device)))

    # -- the handle's side (models.handle: read with the drain's one transfer) --

    def tensor(self) -> Tensor:
        return self.records.reshape(-1)

    def events(self, values: list[float], step: int) -> list[dict[str, object]]:
        """This drain's events (the fields of :class:`~attnchecker.models.handle.Event`)."""
        out = []
        for n, rec in zip(self.norms, _rows(values, 4), strict=True):
            calls, rows, lost, code = rec
            if calls:
                out.append({
                    "step": step, "module": n.name, "layer": n.layer, "op": self.op,
                    "pattern": "1R" if rows == 1 else "2D", "kind": _KINDS[int(code)],
                    "action": "uncorrectable" if lost else "corrected", "n_rows": int(rows),
                    "n_cols": 0, "count": int(calls),
                })  # fmt: skip
        self.records.zero_()
        return out

    def summary(self) -> dict[str, object]:
        return {
            "checked": [n.name for n in self.norms],
            "unchecked": dict(self.unchecked),
        }

    def follow(self, device: torch.device) -> None:
        self.records = self.records.to(device)


def _rows(values: list[float], width: int) -> list[list[float]]:
    return [values[i : i + width] for i in range(0, len(values), width)]
