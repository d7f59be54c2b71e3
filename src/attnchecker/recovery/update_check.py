"""The optimizer update's check (``ABFTConfig(invariants=("update",))``, run by
:func:`attnchecker.guard`): every parameter tensor's new optimizer state and new values against
row checksums of what the update should have written (:mod:`attnchecker.abft.update`).

- **Before the step** one pass over the gradients: their row sums (and of their squares, for
  Adam's second moment). The state's and the parameters' row sums are those this check kept
  after the previous step, so a value that changed *between* steps (memory, a write of the
  previous step's kernel after its check) is seen too; they are recomputed only where a tensor's
  version moved (a user's own write: a load, a reset) or on a first step.
- **After the step** one pass over the new state and parameters: their row sums, compared with
  the prediction (the previous sums when the guard skipped the step). A device count per
  parameter group and quantity, no host read.
- **On the kernels** (CUDA; ``check_impl="triton"`` in the interpreter), AdamW's step runs in
  the checked kernel (:meth:`UpdateCheck.fused_step`): the update and both passes' sums in one
  pass, nothing read twice; a value written wrong after the kernel took its sums is then seen
  at the next step's update.
- **Repair** waits for that count (read with the handle's drain, or by :meth:`settle`: the
  root's next forward does it when no drain came first): a row whose sums disagree has its one
  wrong element located by the weighted sum (or as the row's only non-finite value) and set to
  what makes the row's sums agree; the moments first, then the parameters, whose prediction is
  recomputed from the repaired moments. A row with more than one wrong element is uncorrectable:
  the event says so and the policy decides (the training loop rolls back to its checkpoint).

Covered: ``torch.optim.AdamW``, ``Adam`` (L2 or decoupled weight decay), ``SGD`` (momentum,
dampening, Nesterov, weight decay), fused / foreach / for-loop, ``maximize``. Not covered, and
named in ``summary()``: AMSGrad (its running maximum is not linear), and any other optimizer
(Adafactor's factored moments, Lion's sign, Muon's orthogonalisation). A GradScaler's
``grad_scale`` is divided out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnchecker.abft.update import as_rows, excess, locate, unit
from attnchecker.faults import kind_of
from attnchecker.kernels.invariants import row_sums as sums
from attnchecker.kernels.invariants import use_kernels

__all__ = ["UpdateCheck", "covered"]

_STATE = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def covered(optimizer: Any) -> tuple[str | None, str]:
    """``(rule, "")`` for an optimizer this check covers (``"adam"`` or ``"sgd"``), else
    ``(None, why)``."""
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        if any(g.get("amsgrad") for g in groups):
            return None, "AMSGrad's running maximum of v is not linear in row sums"
        return "adam", ""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd", ""
    return None, f"{type(optimizer).__name__}: only Adam, AdamW and SGD updates are checked"


@dataclass
class _Param:
    """One parameter tensor's kept sums (after the last step) and this step's comparison."""

    name: str
    kept: dict[str, Tensor] = field(default_factory=dict)  # quantity -> (R, 3)
    prev: dict[str, Tensor] = field(default_factory=dict)  # the kept sums this step started from
    versions: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    inputs: dict[str, Tensor] = field(default_factory=dict)  # "g", "g2" this step
    terms: dict[str, list] = field(default_factory=dict)  # quantity -> prediction terms
    coef: dict[str, Any] = field(default_factory=dict)
    rest: Tensor | None = None  # under L2 decay: the parameter moved at rest (device flag)
    fused: dict[str, Tensor] | None = None  # the checked AdamW kernel's sums of this step


class UpdateCheck:
    """The checks of one optimizer's updates; ``counts`` (per tensor x quantity, flagged rows)
    is what a drain reads."""

    op = "update"

    def __init__(self, optimizer: Any, *, names: dict[int, str] | None = None, scale: float = 1.0,
                 kernels: bool = False):  # fmt: skip
        self.optimizer = optimizer
        self.kernels = kernels  # the Triton kernels in the interpreter too (check_impl="triton")
        self.rule, self.why = covered(optimizer)
        self.scale = scale
        names = names or {}
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._state = {id(p): _Param(names.get(id(p), f"param{i}"))
                       for i, p in enumerate(self.params)}  # fmt: skip
        self.keys = ("param", *_STATE.get(self.rule or "", ()))
        dev = self.params[0].device if self.params else torch.device("cpu")
        dev = torch.device("cpu") if dev.type == "meta" else dev
        # flagged rows per parameter group and quantity, and a last column: under L2 decay, a
        # parameter changed since the last step (its gradient input is then wrong too)
        groups = len(optimizer.param_groups)
        self.counts = torch.zeros(groups, len(self.keys) + 1, dtype=torch.float64,
                                  device=dev)  # fmt: skip
        self.pending = False  # an update checked whose counts no drain has read yet
        self._skip = torch.zeros((), dtype=torch.bool)  # whether the last step was skipped
        self.corrected = self.uncorrectable = 0

    # -- around the optimizer's step (the guard calls these) --

    def can_fuse(self) -> bool:
        """Whether the step itself can run in the checked AdamW kernel
        (:func:`attnchecker.kernels.invariants.checked_adamw`: the update and its row sums in
        one pass, nothing read twice): decoupled weight decay (AdamW), no AMSGrad, float
        learning rates, dense contiguous parameters where the kernels run (CUDA;
        ``check_impl="triton"`` in the interpreter)."""
        if self.rule != "adam" or not self.params:
            return False
        groups = self.optimizer.param_groups
        return (
            all(self._decoupled(g) and not g.get("amsgrad") and isinstance(g["lr"], float)
                and not g.get("differentiable") for g in groups)
            and all(_local(p).is_contiguous() and not _local(p).is_sparse for p in self.params)
            and use_kernels(_local(self.params[0]), self.kernels)
        )  # fmt: skip

    def fused_step(self, skipped: Tensor) -> None:
        """AdamW's step in the checked kernel (one launch a tensor), its state kept as
        ``torch.optim.AdamW`` keeps it (``step`` a float32 tensor on the device, as fused and
        capturable AdamW do), skipped on the device where ``skipped``; then :meth:`after` reads
        the sums the kernel took."""
        from attnchecker.kernels.invariants import checked_adamw

        for s in self._state.values():
            s.inputs, s.fused = {}, None
        scale = getattr(self.optimizer, "grad_scale", None)
        for group in self.optimizer.param_groups:
            active = [p for p in group["params"] if p.grad is not None]
            if not active:
                continue
            dev = _local(active[0]).device
            for p in active:
                st = self.optimizer.state[p]
                if not st:  # a first step: AdamW's own state, zeros
                    st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
                    st["exp_avg"] = torch.zeros_like(_local(p), memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(_local(p),
                                                        memory_format=torch.preserve_format)
                elif st["step"].device != dev:  # a for-loop or foreach AdamW's CPU step count
                    st["step"] = st["step"].to(dev, torch.float32)
                self._refresh(p, self._state[id(p)])
            steps = [self.optimizer.state[p]["step"] for p in active]
            keep = (1 - skipped.to(dev).float()).reshape(())
            torch._foreach_add_(steps, [keep] * len(steps))  # a skipped step does not count
            b1, b2 = (float(b) for b in group["betas"])
            t = steps[0].double()
            one = torch.ones((), dtype=torch.float64, device=dev)  # (a fill: no copy from host)
            inv = one if scale is None else 1 / scale.to(dev, torch.float64).reshape(())
            sign = -one if group.get("maximize") else one
            coef = torch.stack([-group["lr"] / (1 - b1**t), (1 - b2**t).rsqrt(),
                                skipped.to(dev, torch.float64).reshape(()), inv, sign])
            decay = 1 - group["lr"] * group["weight_decay"]
            for p in active:
                st = self.optimizer.state[p]
                rows = [as_rows(_local(t)) for t in (p.detach(), p.grad, st["exp_avg"],
                                                     st["exp_avg_sq"])]  # fmt: skip
                out = checked_adamw(*rows, coef, decay, b1, b2, float(group["eps"]))
                s = self._state[id(p)]
                s.inputs = {"g": out[:, 0], "g2": out[:, 1]}
                s.fused = dict(zip(("param", "exp_avg", "exp_avg_sq", "r"),
                                   (out[:, i] for i in range(2, 6)), strict=True))  # fmt: skip

    def before(self) -> Tensor | None:
        """Row sums of this step's gradients; the kept sums refreshed where stale. Returns,
        under L2 weight decay, a device flag: a parameter changed at rest (its gradient input
        is then wrong: the guard skips the step, and the repair puts the parameter back)."""
        if self.rule is None:
            return None
        rest = []
        for s in self._state.values():
            s.inputs = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self._state[id(p)]
                self._refresh(p, s)
                g = _local(p.grad).float()
                gs = getattr(self.optimizer, "grad_scale", None)
                if isinstance(gs, Tensor):
                    g = g / gs.to(g.device)
                if group.get("maximize"):
                    g = -g
                wd = group.get("weight_decay", 0.0)
                s.rest = None
                if wd and not self._decoupled(group):
                    w = _local(p).detach()
                    g = g + wd * w.float()  # L2: the gradient the step uses
                    # a parameter changed at rest corrupts that gradient: not repairable
                    _, moved = excess(self._sums(w)[0], [(1.0, s.kept["param"])], unit(p.dtype),
                                      self.scale)  # fmt: skip
                    s.rest = (moved > 0).any().double()
                    rest.append(s.rest)
                s.inputs = dict(zip(("g", "g2"), self._sums(g, square=True), strict=True))
        return torch.stack(rest).amax().float() if rest else None

    def after(self, skipped: Tensor) -> None:
        """Row sums of the new state and parameters against the prediction (the kept sums
        where ``skipped``), into :attr:`counts` (device only). One launch a tensor for the
        sums; the comparison is vectorised over each parameter group's tensors (the same
        coefficients), a handful of ops a group and quantity."""
        if self.rule is None:
            return
        skip = skipped.to(self.counts.device) > 0
        self._skip = skip
        width = len(self.keys) + 1
        flagged = []
        for group in self.optimizer.param_groups:
            active = [p for p in group["params"] if self._state[id(p)].inputs]
            if not active:
                flagged.append(torch.zeros(width, dtype=torch.float64, device=skip.device))
                continue
            coef = self._coef(active[0], group)  # a group steps together: one step count
            news = [self._new(p, coef) for p in active]
            states = [self._state[id(p)] for p in active]
            for st, new in zip(states, news, strict=True):
                st.coef = coef
                st.terms = self._terms(st, group, new, st.kept)
            u = max(unit(p.dtype) for p in active)
            row = []
            for k in self.keys:
                over = self._compare(k, news, states, u, skip)
                row.append(torch.zeros((), dtype=torch.float64, device=skip.device)
                           if over is None else (over > 0).sum().double())  # fmt: skip
            rests = [st.rest for st in states if st.rest is not None]
            row.append(torch.stack(rests).amax() * ~skip if rests else
                       torch.zeros((), dtype=torch.float64, device=skip.device))  # fmt: skip
            flagged.append(torch.stack([r.to(skip.device) for r in row]))
            for p, st, new in zip(active, states, news, strict=True):
                st.prev, st.kept = st.kept, {k: v for k, v in new.items() if k != "r"}
                st.versions = self._versions(p)
        if flagged:
            self.counts.add_(torch.stack(flagged).to(self.counts.device))
            self.pending = True

    def _compare(self, k: str, news: list, states: list, u: float, skip: Tensor) -> Tensor | None:
        """Per row of the group's tensors that have quantity ``k``: the excess over the
        tolerance of the delivered sums against the prediction (against the kept sums where the
        step was skipped). Tensors whose prediction has other coefficients (SGD's first
        momentum step) are compared in their own batch."""
        batches: dict[tuple, list[int]] = {}
        for i, (new, st) in enumerate(zip(news, states, strict=True)):
            if k in new:
                sig = tuple(a if isinstance(a, float) else id(a) for a, _ in st.terms[k])
                batches.setdefault(sig, []).append(i)
        if not batches:
            return None
        parts = []
        for idx in batches.values():
            got = torch.cat([news[i][k] for i in idx])
            terms = [(a, torch.cat([states[i].terms[k][t][1] for i in idx]))
                     for t, (a, _) in enumerate(states[idx[0]].terms[k])]  # fmt: skip
            _, over = excess(got, terms, u, self.scale)
            kept = [states[i].kept.get(k) for i in idx]
            if all(x is not None for x in kept):  # a skipped step leaves the kept sums
                _, over_kept = excess(got, [(1.0, torch.cat(kept))], u, self.scale)
                over = torch.where(skip, over_kept, over)
            parts.append(over)
        return torch.cat(parts)

    def _decoupled(self, group: dict) -> bool:
        return isinstance(self.optimizer, torch.optim.AdamW) or bool(
            group.get("decoupled_weight_decay")
        )

    def _tensors(self, p: Tensor) -> dict[str, Tensor]:
        st = self.optimizer.state.get(p, {})
        out = {"param": _local(p).detach()}
        for k in self.keys[1:]:
            if isinstance(st.get(k), Tensor):
                out[k] = _local(st[k])
        return out

    def _versions(self, p: Tensor) -> dict[str, tuple[int, int, int]]:
        """Each tensor's identity and version: a tensor replaced (an optimizer's state loaded
        from a checkpoint) or written since is re-summed."""
        st = self.optimizer.state.get(p, {})
        owners = {"param": p} | {k: st[k] for k in self.keys[1:] if isinstance(st.get(k), Tensor)}
        return {k: (id(t), _local(t).data_ptr(), _local(t)._version) for k, t in owners.items()}

    def _refresh(self, p: Tensor, s: _Param) -> None:
        """The kept sums of a tensor someone else wrote since (or never seen)."""
        now = self._versions(p)
        for k, t in self._tensors(p).items():
            if k not in s.kept or s.versions.get(k) != now[k]:
                s.kept[k] = self._sums(t)[0]
        s.versions = now

    def _coef(self, p: Tensor, group: dict) -> dict[str, Any]:
        lr = group["lr"]
        lr = lr.to(torch.float64) if isinstance(lr, Tensor) else float(lr)
        wd = float(group.get("weight_decay", 0.0))
        if self.rule == "sgd":
            return {"lr": lr, "wd": wd, "mu": float(group.get("momentum", 0.0)),
                    "damp": float(group.get("dampening", 0.0)),
                    "nesterov": bool(group.get("nesterov"))}  # fmt: skip
        b1, b2 = (float(b) for b in group["betas"])
        step = self.optimizer.state[p]["step"]
        step = step.to(torch.float64) if isinstance(step, Tensor) else float(step)
        bc2 = 1 - b2**step
        root = bc2.sqrt() if isinstance(bc2, Tensor) else bc2**0.5
        root = torch.as_tensor(root, dtype=torch.float64).reshape(1).to(_local(p).device)
        wd = wd if self._decoupled(group) else 0.0
        # the group's coefficients, computed once: a tensor made a parameter would make every
        # parameter a batch of its own in _compare
        return {"lr": lr, "wd": wd, "b1": b1, "b2": b2, "eps": float(group["eps"]),
                "bc1": 1 - b1**step, "bc2": bc2, "root": root, "decay": 1 - lr * wd,
                "step_size": -lr / (1 - b1**step)}  # fmt: skip

    def _sums(self, *tensors: Tensor, **kw: Any) -> list[Tensor]:
        return sums(*tensors, kernel=use_kernels(tensors[0], self.kernels), **kw)

    def _new(self, p: Tensor, c: dict[str, Any]) -> dict[str, Tensor]:
        """Row sums of the parameter and its state after the step, and (Adam, with both
        moments) of ``r = m' / (sqrt(v') / sqrt(bc2) + eps)``, in one pass."""
        fused = self._state[id(p)].fused
        if fused is not None:  # the checked kernel took them as it wrote
            self._state[id(p)].fused = None
            return fused
        tensors = self._tensors(p)
        if self.rule == "adam" and len(tensors) == 3:
            out = self._sums(*tensors.values(), adam=(c["root"], c["eps"]))
            return dict(zip((*tensors, "r"), out, strict=True))
        return dict(zip(tensors, self._sums(*tensors.values()), strict=True))

    def _terms(
        self, s: _Param, group: dict, got: dict[str, Tensor], kept: dict[str, Tensor]
    ) -> dict[str, list]:
        c, ins = s.coef, s.inputs

        def old(key: str) -> Tensor:  # a first step's state: zeros
            return kept[key] if key in kept else torch.zeros_like(ins["g"])

        if self.rule == "adam":
            return {
                "exp_avg": [(c["b1"], old("exp_avg")), (1 - c["b1"], ins["g"])],
                "exp_avg_sq": [(c["b2"], old("exp_avg_sq")), (1 - c["b2"], ins["g2"])],
                "param": [(c["decay"], kept["param"]), (c["step_size"], got["r"])],
            }
        lr, mu = c["lr"], c["mu"]
        if mu == 0:
            return {"param": [(1.0, kept["param"]), (-lr, ins["g"])]}
        buf = [(1.0, ins["g"])] if "momentum_buffer" not in kept else [
            (mu, kept["momentum_buffer"]), (1 - c["damp"], ins["g"])]  # fmt: skip
        new_buf = got["momentum_buffer"] if "momentum_buffer" in got else old("momentum_buffer")
        step = [(-lr, ins["g"]), (-lr * mu, new_buf)] if c["nesterov"] else [(-lr, new_buf)]
        return {"momentum_buffer": buf, "param": [(1.0, kept["param"]), *step]}

    # -- after the drain's read --

    def tensor(self) -> Tensor:
        return self.counts.reshape(-1)

    def events(self, values: list[float], step: int) -> list[dict[str, object]]:
        """Repair what the counts flag (host work, the fault path only); this drain's events."""
        self.pending = False
        if not any(values):
            self.counts.zero_()
            return []
        width = len(self.keys) + 1
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            if any(values[gi * width : (gi + 1) * width]):  # find its tensors, then repair them
                for p in group["params"]:
                    out += self._repair(p, self._state[id(p)], step)
        self.counts.zero_()
        return out

    def _repair(self, p: Tensor, s: _Param, step: int) -> list[dict]:
        group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
        tensors = self._tensors(p)
        u = unit(p.dtype)
        out = []
        for k in (*self.keys[1:], "param"):  # the moments first: the parameters' prediction
            # reads them
            if k not in tensors:
                continue
            if k == "param":  # re-predicted from the repaired moments
                now = self._new(p, s.coef)
                s.terms = self._terms(s, group, now, s.prev)
            got = self._sums(tensors[k])[0]
            pred = sum(a * x[:, :2] for a, x in s.terms[k])
            _, over = excess(got, s.terms[k], u, self.scale)
            rows = (over > 0).nonzero().flatten().tolist()
            if not rows:
                continue
            fixed = [self._fix(tensors[k], r, got[r], pred[r]) for r in rows]
            # under L2 decay a parameter changed at rest also changed the gradient the step
            # used: its moments cannot be rebuilt from row sums (unless the step was skipped)
            moved = s.rest is not None and bool(s.rest) and not bool(self._skip.any())
            lost = len(rows) if moved else sum(v is None for v in fixed)
            value = next((v for v in fixed if v is not None), float("nan"))
            self.corrected += len(rows) - lost
            self.uncorrectable += lost
            out.append({
                "step": step, "module": s.name, "layer": -1, "op": f"{self.op}.{k}",
                "pattern": "0D" if len(rows) == 1 else "2D",
                "kind": kind_of(value) if not lost else "unknown",
                "action": "uncorrectable" if lost else "corrected", "n_rows": len(rows),
                "n_cols": 1, "value": value if math.isfinite(value) else None,
            })  # fmt: skip
        s.kept = {k: v for k, v in self._new(p, s.coef).items() if k != "r"}
        s.versions = self._versions(p)
        return out

    @staticmethod
    def _fix(t: Tensor, r: int, got: Tensor, pred: Tensor) -> float | None:
        """Set the one wrong element of row ``r`` so the row's sum is the predicted one; the
        wrong value, or None when the row's error is not one element."""
        x = as_rows(t)[r]  # a view (t is contiguous: parameters and optimizer state are)
        bad = (~torch.isfinite(x)).nonzero().flatten()
        if len(bad) > 1:
            return None
        j = int(bad[0]) if len(bad) else locate(got[:2] - pred, x.numel())
        if j is None:
            return None
        x64 = x.double()
        was = float(x64[j])
        others = torch.cat([x64[:j], x64[j + 1 :]]).sum()
        with torch.no_grad():
            x[j] = pred[0] - others
        return was

    def follow(self, device: torch.device) -> None:
        self.counts = self.counts.to(device)

    def summary(self) -> dict[str, object]:
        return {
            "optimizer": type(self.optimizer).__name__,
            "checked": self.rule is not None,
            "why_not": self.why or None,
            "quantities": list(self.keys) if self.rule else [],
            "corrected": self.corrected,
            "uncorrectable": self.uncorrectable,
        }
