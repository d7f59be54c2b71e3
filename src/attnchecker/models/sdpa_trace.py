"""One forward of a model on an example input, traced: where it calls attention, and which
linear layers produce each call's Q, K and V and consume its output.

A :class:`torch.overrides.TorchFunctionMode` records, per innermost running module (forward
pre / post hooks keep the stack), the attention-like functions it calls (SDPA,
``F.multi_head_attention_forward``, products, softmax) and the operands of its first SDPA
call. Gradients are on for that forward, so each operand's autograd graph leads back to the
linear layers that made it: the nearest linear weight on every path (through views, splits,
rotary embeddings, norms) names the projection of Q, of K and of V; a layer whose input's
graph reaches the attention output is its output projection. One layer that makes all of Q, K
and V is a fused projection, split Q | K | V contiguously (nanoGPT, litgpt, timm's
``reshape(..., 3, H, D)``) or per head (GPT-NeoX): which one is read from V, compared bitwise
with the layer's output under each layout (neither: no projections, with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from attnchecker.attention.projection import ProjectionSpec
from attnchecker.errors import UnsupportedModelError
from attnchecker.models.families import Wiring
from attnchecker.models.registry import SITES, projection_spec

__all__ = ["Found", "trace"]

_SDPA = F.scaled_dot_product_attention
_PRODUCTS = frozenset({torch.matmul, torch.bmm, torch.einsum, Tensor.matmul, Tensor.__matmul__})
_SOFTMAX = frozenset({torch.softmax, F.softmax, Tensor.softmax})
_KINDS = {_SDPA: "sdpa", F.multi_head_attention_forward: "mha"}
_WALK = 400  # autograd nodes visited per operand at most


@dataclass(frozen=True)
class Found:
    """The modules of a model around its attention calls: ``sdpa`` (qualified names, in call
    order: SDPA's callers and ``nn.MultiheadAttention`` modules), ``handwritten`` (a product,
    a softmax and a product again, without SDPA) and, from a traced forward, each SDPA
    caller's ``projections``."""

    sdpa: tuple[str, ...]
    handwritten: tuple[str, ...]
    projections: dict[str, tuple[ProjectionSpec, ...]] = field(default_factory=dict)


class _Recorder(TorchFunctionMode):
    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: dict[str, list[str]] = {}
        self.operands: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # q, k, v, out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stack and (func in _KINDS or func in _PRODUCTS or func in _SOFTMAX):
            kind = _KINDS.get(func) or ("softmax" if func in _SOFTMAX else "product")
            self.calls.setdefault(self.stack[-1], []).append(kind)
            if kind == "sdpa" and len(args) >= 3:
                self.operands.setdefault(self.stack[-1], (*args[:3], out))
        return out


def trace(model: nn.Module, example: tuple | dict) -> Found:
    """Where ``model`` calls attention, and its projections, from one forward on ``example``
    (positional arguments, or keyword arguments as a dict), gradients on."""
    stack: list[str] = []  # the running modules, innermost last
    io: dict[str, tuple[Tensor, Tensor]] = {}  # each linear layer's last (input, output)

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: stack.append(name)

    def leave(*_: object) -> None:  # (a forward hook's non-None return replaces the output)
        stack.pop()

    def keep(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, out: object) -> None:
            if args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
                io[name] = (args[0], out)

        return hook

    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(enter(name)))
        handles.append(m.register_forward_hook(leave))
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(keep(name)))
    recorder = _Recorder(stack)
    try:
        with torch.enable_grad(), recorder:
            model(**example) if isinstance(example, dict) else model(*example)
    finally:
        for h in handles:
            h.remove()
    calls = recorder.calls
    sdpa = tuple(n for n, c in calls.items() if {"sdpa", "mha"} & set(c))
    hand = tuple(n for n, c in calls.items() if n not in sdpa and _looks(c))
    modules = dict(model.named_modules())
    weights = {id(modules[n].weight): n for n in io}
    projections = {
        n: _projections(n, recorder.operands[n], io, weights, modules)
        for n in sdpa
        if n in recorder.operands
    }
    return Found(sdpa, hand, projections)


def _looks(calls: list[str]) -> bool:
    """A product, then a softmax, then a product: attention written by hand."""
    seq = "".join({"product": "p", "softmax": "s", "sdpa": "a", "mha": "m"}[c] for c in calls)
    i = seq.find("p")
    j = seq.find("s", i + 1) if i >= 0 else -1
    return j >= 0 and seq.find("p", j + 1) >= 0


def _linear_at(fn, weights: dict[int, str]) -> str | None:
    """The linear layer whose weight enters autograd node ``fn`` (directly or transposed)."""
    for child, _ in fn.next_functions:
        for node in (child, *(c for c, _ in getattr(child, "next_functions", ()))):
            if node is not None and id(getattr(node, "variable", None)) in weights:
                return weights[id(node.variable)]
    return None


def _upstream(t: Tensor, limit: int, stop: Callable[[object], bool] = lambda fn: False):
    """The autograd nodes upstream of ``t``, breadth first, at most ``limit``; the nodes above
    one that ``stop`` accepts are not walked."""
    todo, seen = [t.grad_fn], set()
    while todo and len(seen) < limit:
        fn = todo.pop(0)
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        yield fn
        if not stop(fn):
            todo += [c for c, _ in fn.next_functions]


def _feeding(t: Tensor, weights: dict[int, str]) -> set[str]:
    """The linear layers nearest upstream of ``t`` on each path of its autograd graph."""
    hits: dict[object, str | None] = {}

    def stop(fn) -> bool:  # at a linear layer: this path ends there
        hits[fn] = _linear_at(fn, weights)
        return hits[fn] is not None

    for _ in _upstream(t, _WALK, stop):
        pass
    return {h for h in hits.values() if h is not None}


def _reaches(t: Tensor, target, limit: int = 60) -> bool:
    """Whether autograd node ``target`` is upstream of ``t`` within ``limit`` nodes."""
    return any(fn is target for fn in _upstream(t, limit))


def _projections(
    where: str,
    operands: tuple[Tensor, Tensor, Tensor, Tensor],
    io: dict[str, tuple[Tensor, Tensor]],
    weights: dict[int, str],
    modules: dict[str, nn.Module],
) -> tuple[ProjectionSpec, ...]:
    """The projections of the SDPA call in ``where``: each of Q, K, V from one linear layer,
    grouped by layer; the output projection; () with a warning when the layout is not one the
    checks implement."""
    q, k, v, out = operands
    if q.dim() != 4 or any(x.grad_fn is None for x in (q, k, v)):
        return ()
    sources = {s: _feeding(t, weights) for s, t in zip("qkv", (q, k, v), strict=True)}
    if any(len(src) != 1 for src in sources.values()):
        return _unknown(where, f"Q, K, V come from {sources}")
    by_layer: dict[str, str] = {}
    for s, src in sources.items():
        by_layer[next(iter(src))] = by_layer.get(next(iter(src)), "") + s
    d, nh = q.shape[-1], q.shape[1]
    specs = []
    for name, sites in by_layer.items():
        if sites not in SITES:
            return _unknown(where, f"{name} makes {sites}")
        interleaved = False
        if len(sites) > 1:
            layout = _layout(io[name][1], v, d, nh, len(sites))
            if layout is None:
                return _unknown(where, f"{name}'s outputs split into {sites} in no known layout")
            interleaved = layout == "heads"
        wiring = Wiring(projections=(), interleaved=interleaved)
        try:
            specs.append(projection_spec(modules[name], SITES[sites], d, nh, wiring, where))
        except UnsupportedModelError as e:
            return _unknown(where, str(e))
    if out.grad_fn is not None:
        taken = set(by_layer)
        outs = [n for n, (x, _) in io.items() if n not in taken and _reaches(x, out.grad_fn)]
        if outs:  # its columns grouped by head size where they divide (x-transformers: not)
            m = modules[outs[0]]
            width = m.weight.shape[0]
            groups = width // d if width % d == 0 else nh if width % nh == 0 else 1
            specs.append(ProjectionSpec(SITES["out"], m, groups))
    return tuple(specs)


def _layout(y: Tensor, v: Tensor, d: int, nh: int, n_sites: int) -> str | None:
    """How a fused projection's output y (..., width) holds V: ``"contiguous"`` (Q | K | V),
    ``"heads"`` (per head, [q_h | k_h | v_h]) or None, read by comparing V (B, Hv, L, d; K/V
    heads repeated by hand are compared at their first copy) bitwise."""
    if y.dim() != 3:
        return None
    B, L, width = y.shape
    n_kv = (width // d - nh) // 2 if n_sites == 3 else width // d // 2
    if n_kv <= 0 or v.shape[1] % n_kv or v.shape[0] != B or v.shape[2] != L:
        return None
    first = v[:, :: v.shape[1] // n_kv]  # (B, n_kv, L, d)
    tail = y[..., width - n_kv * d :].unflatten(-1, (n_kv, d)).transpose(1, 2)
    if torch.equal(tail, first):
        return "contiguous"
    if width == n_sites * nh * d and n_kv == nh:
        per_head = y.unflatten(-1, (nh, n_sites, d))[..., -1, :].transpose(1, 2)
        if torch.equal(per_head, first):
            return "heads"
    return None


def _unknown(where: str, why: str) -> tuple[ProjectionSpec, ...]:
    warnings.warn(
        f"attnchecker: {where}: its projections are not checked as attention projections "
        f"({why}); scope='all_linear' checks them as linear layers",
        RuntimeWarning,
        stacklevel=4,
    )
    return ()
