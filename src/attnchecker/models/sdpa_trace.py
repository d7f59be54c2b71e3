"""One forward of a model on an example input, traced: where it calls attention, and which
linear layers produce each call's Q, K and V and consume its output.

A :class:`torch.overrides.TorchFunctionMode` records, per innermost running module (forward
pre / post hooks keep the stack), the attention-like functions it calls (SDPA,
``F.multi_head_attention_forward``, products, softmax) and the operands of its first SDPA
call. Gradients are on for that forward, so each operand's autograd graph leads back to the
linear layers that made it: the nearest linear weight on every path (through views, splits,
rotary embeddings, norms) names the projection of Q, of K and of V; a layer whose input's
graph reaches the attention output is its output projection. One layer that makes all of Q, K
and V (or K and V) is a fused projection, in one of the layouts the checks implement
(:class:`~attnchecker.attention.checks.Projection`):

- Q | K | V contiguous over the whole output, GQA widths included (nanoGPT, litgpt, timm's
  ``reshape(..., 3, H, D)``);
- interleaved per K/V group, [the nh / n_kv query heads of group g | k_g | v_g] (Megatron-LM's
  ``linear_qkv``, torchtitan's ``wqkv``; GPT-NeoX's per-head [q_h | k_h | v_h] is one query
  head a group);
- Q | K | V contiguous at an offset, features no site names around them (timm's
  ``ParallelScalingBlock``: [MLP input | Q | K | V]; those features are the same GEMM, checked
  with the sites and counted with Q).

Which one is read from V, compared bitwise with the layer's output under each layout (none: no
projections, and the reason, :attr:`Found.unfound`). ``nn.MultiheadAttention`` has no linear
layer for its in-projection: the rows of its ``in_proj_weight`` that each of its GEMMs uses (one for
self-attention, Q and K | V when key is value, else three: as the traced call splits them) are
its projections, run and checked by ``models.sdpa.checked_mha``, and ``out_proj`` its output
projection.

Attention functions that are not SDPA calls (:data:`UNROUTED`: flex attention, flash-attn's
functions, varlen attention) are seen running, not read from source text: for the forward,
every such function a module's class could call (bound in its module's globals, in its class,
or in the function's home module) is replaced by a recorder that notes the innermost running
module and calls the function. A module whose source merely names one (torchtitan's
``_get_flex_attention_masks``, a method that builds masks) is not refused for it; one that ran
and in which no attention at all was seen is named (:attr:`Found.unseen`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from attnchecker.attention.projection import ProjectionSpec
from attnchecker.errors import UnsupportedModelError
from attnchecker.models.families import Wiring
from attnchecker.models.registry import SITES, projection_spec

__all__ = ["UNROUTED", "Found", "class_source", "mha_split", "source_names", "trace", "trace_call"]

_SDPA = F.scaled_dot_product_attention
_PRODUCTS = frozenset({torch.matmul, torch.bmm, torch.einsum, Tensor.matmul, Tensor.__matmul__})
_SOFTMAX = frozenset({torch.softmax, F.softmax, Tensor.softmax})
_KINDS = {_SDPA: "sdpa", F.multi_head_attention_forward: "mha"}
_WALK = 400  # autograd nodes visited per operand at most
_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")  # after q, k, v


@dataclass(frozen=True)
class Found:
    """The modules of a model around its attention calls: ``sdpa`` (qualified names, in call
    order: SDPA's callers and ``nn.MultiheadAttention`` modules), ``handwritten`` (a product,
    a softmax and a product again, without SDPA) and, from a traced forward, each SDPA
    caller's ``projections``."""

    sdpa: tuple[str, ...]
    handwritten: tuple[str, ...]
    projections: dict[str, tuple[ProjectionSpec, ...]] = field(default_factory=dict)
    calls: dict[str, tuple[tuple[Tensor, ...], dict, Tensor]] = field(default_factory=dict)
    """Each SDPA caller's first call, detached: ((q, k, v), SDPA's other arguments by name,
    SDPA's output), for the probe of the checked core (``sdpa.probe``)."""
    unrouted: tuple[str, ...] = ()
    """``name (function)`` of each module seen running an attention function of
    :data:`UNROUTED` (not an SDPA call: a mode cannot route it)."""
    unfound: dict[str, str] = field(default_factory=dict)
    """Why an SDPA caller's projections were not found (a layout not understood, Q from no
    single linear layer), by module name."""
    unseen: tuple[str, ...] = ()
    """``name (function)`` of each module whose source names an :data:`UNROUTED` function,
    that ran, and in which (nested modules included) neither SDPA nor that function was seen:
    where attention may run unseen (called through a path the recorders do not replace)."""


class _Recorder(TorchFunctionMode):
    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: dict[str, list[str]] = {}
        self.operands: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # q, k, v, out
        self.kwargs: dict[str, dict] = {}  # the other arguments of that call, by name
        self.mha: dict[str, tuple[str, ...]] = {}  # its in-projection's GEMMs (mha_split)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stack and (func in _KINDS or func in _PRODUCTS or func in _SOFTMAX):
            kind = _KINDS.get(func) or ("softmax" if func in _SOFTMAX else "product")
            self.calls.setdefault(self.stack[-1], []).append(kind)
            if func is _SDPA and len(args) >= 3:
                self.operands.setdefault(self.stack[-1], (*args[:3], out))
                named = dict(zip(_SDPA_ARGS, args[3:], strict=False)) | (kwargs or {})
                self.kwargs.setdefault(self.stack[-1], named)
            if func is F.multi_head_attention_forward and len(args) >= 3:
                self.mha.setdefault(self.stack[-1], mha_split(*args[:3]))
        return out


def trace(model: nn.Module, example: tuple | dict) -> Found:
    """Where ``model`` calls attention, and its projections, from one forward on ``example``
    (positional arguments, or keyword arguments as a dict), gradients on."""
    if isinstance(example, dict):
        return trace_call(model, (), example)
    return trace_call(model, tuple(example), {})


def trace_call(model: nn.Module, args: tuple, kwargs: dict) -> Found:
    """:func:`trace` of the forward ``model(*args, **kwargs)``. A forward that fails after an
    attention function of :data:`UNROUTED` ran (flex attention has no CPU backward) is
    refused naming it; any other failure is the model's own and propagates."""
    stack: list[str] = []  # the running modules, innermost last
    io: dict[str, tuple[Tensor, Tensor]] = {}  # each linear layer's last (input, output)

    ran: set[str] = set()

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            stack.append(name)
            ran.add(name)

        return hook

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
    recorder, seen = _Recorder(stack), {}
    try:
        with torch.enable_grad(), _watching(model, stack, seen), recorder:
            model(*args, **kwargs)
    except Exception as e:
        if not seen:
            raise
        raise UnsupportedModelError(
            f"{type(model).__name__} calls attention that is not scaled_dot_product_attention "
            f"in {', '.join(_where(model, seen))}; protect_ cannot route it to the checked "
            f"core (its forward then failed: {type(e).__name__}: {e})"
        ) from e
    finally:
        for h in handles:
            h.remove()
    calls = recorder.calls
    sdpa = tuple(n for n, c in calls.items() if {"sdpa", "mha"} & set(c))
    hand = tuple(n for n, c in calls.items() if n not in sdpa and _looks(c))
    modules = dict(model.named_modules())
    weights = {id(modules[n].weight): n for n in io}
    others = {id(p): n for n, p in model.named_parameters() if id(p) not in weights}
    projections, unfound = {}, {}
    for n in sdpa:
        if n in recorder.operands:
            operands = recorder.operands[n]
            projections[n], why = _projections(n, operands, io, weights, others, modules)
            if why:
                unfound[n] = why
    for n, split in recorder.mha.items():
        if isinstance(modules[n], nn.MultiheadAttention):
            projections[n] = _mha_projections(n, modules[n], split)
    calls = {
        n: (tuple(t.detach() for t in recorder.operands[n][:3]),
            {k: v.detach() if isinstance(v, Tensor) else v for k, v in recorder.kwargs[n].items()},
            recorder.operands[n][3].detach())
        for n in sdpa
        if n in recorder.operands
    }  # fmt: skip
    attention = (*sdpa, *seen, *hand)  # where attention was seen running
    unseen = tuple(
        f"{n or type(model).__name__} ({names[0]})"
        for n, m in modules.items()
        if n in ran and (names := source_names(m)) and not _holds(n, attention)
    )
    return Found(sdpa, hand, projections, calls, _where(model, seen), unfound, unseen)


def _holds(module: str, names: Iterable[str]) -> bool:
    """Whether ``module`` is one of ``names`` or holds one (the root holds every module)."""
    return any(not module or n == module or n.startswith(f"{module}.") for n in names)


def _where(model: nn.Module, seen: dict[str, str]) -> tuple[str, ...]:
    """``name (function)`` of each module seen running an :data:`UNROUTED` function."""
    return tuple(f"{n or type(model).__name__} ({f})" for n, f in seen.items())


UNROUTED = (
    "flex_attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "varlen_attn",
)  # fmt: skip
"""Attention functions that are not SDPA calls, by name: a module seen running one is refused
(or, with ``strict=False``, named as unchecked)."""

_HOMES = {
    "flex_attention": ("torch.nn.attention.flex_attention",),
    "flash_attn_": ("flash_attn", "flash_attn.flash_attn_interface"),
    "varlen_attn": ("torch.nn.attention.varlen",),
}
"""What source text may name (a function, or flash-attn's by prefix), and the modules that
define it: imported for the trace where installed, so a call through the module (an import
inside a forward) is seen too."""
_NAMED = tuple(_HOMES)


@functools.cache
def class_source(cls: type) -> str:
    """The source text of a class ("" where there is none), read once per class."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def source_names(m: nn.Module) -> list[str]:
    """The attention functions of :data:`UNROUTED` (by prefix: ``flash_attn_``) that the source
    of ``m``'s class names: where to look, never a reason to refuse."""
    src = class_source(type(m))
    return [f for f in _NAMED if f in src]


def _unrouted_name(fn: object) -> str | None:
    """The :data:`UNROUTED` name of ``fn``, of the function it wraps (``functools.wraps``) or
    that ``torch.compile`` wrapped, else None."""
    for f in (fn, getattr(fn, "__wrapped__", None), getattr(fn, "_torchdynamo_orig_callable", 0)):
        name = getattr(f, "__name__", None)
        if name in UNROUTED:
            return name
    return None


@contextmanager
def _watching(model: nn.Module, stack: list[str], seen: dict[str, str]) -> Iterator[None]:
    """For the body, every :data:`UNROUTED` function that the classes of ``model``'s modules
    whose source names one could call (their modules' globals, their classes' attributes) and
    the functions' home modules hold is a recorder: ``seen`` gets the innermost running module
    and the function's name. Restored on exit."""
    named = {m: names for m in model.modules() if (names := source_names(m))}
    classes = {c for m in named for c in type(m).__mro__ if c not in (nn.Module, object)}
    homes = {f for names in named.values() for f in names}
    spaces = [vars(home) for f in sorted(homes) for home in _homes(f)]
    spaces += [vars(sys.modules[c.__module__]) for c in classes if c.__module__ in sys.modules]
    patched: list[tuple[object, str, object]] = []
    for cls in classes:
        patched += _patch_class(cls, stack, seen)
    for space in {id(s): s for s in spaces}.values():
        for key, fn in list(space.items()):
            if (name := _unrouted_name(fn)) is not None:
                space[key] = _recorder(fn, name, stack, seen)
                patched.append((space, key, fn))
    try:
        yield
    finally:
        for where, key, fn in reversed(patched):
            if isinstance(where, dict):
                where[key] = fn
            else:
                setattr(where, key, fn)


def _homes(name: str) -> list[types.ModuleType]:
    """The modules defining the functions ``name`` stands for, those installed."""
    out = []
    for home in _HOMES[name]:
        try:
            out.append(importlib.import_module(home))
        except ImportError:
            continue
    return out


def _patch_class(cls: type, stack: list[str], seen: dict[str, str]) -> list:
    out = []
    for key, fn in list(vars(cls).items()):
        raw = fn.__func__ if isinstance(fn, staticmethod) else fn
        if (name := _unrouted_name(raw)) is not None:
            wrapped = _recorder(raw, name, stack, seen)
            setattr(cls, key, staticmethod(wrapped) if isinstance(fn, staticmethod) else wrapped)
            out.append((cls, key, fn))
    return out


def _recorder(fn: Callable, name: str, stack: list[str], seen: dict[str, str]) -> Callable:
    """``fn`` noting, when called, the innermost running module under ``name``; a plain
    function where ``fn`` is one (it binds as a method the same way), else an object that
    does not bind."""

    def record(*args: object, **kwargs: object) -> object:
        seen.setdefault(stack[-1] if stack else "", name)
        return fn(*args, **kwargs)

    if isinstance(fn, types.FunctionType):
        return record
    return _Unbound(record)


class _Unbound:
    """A callable that stays unbound as a class attribute (as a compiled function or a builtin
    does)."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._fn(*args, **kwargs)


def mha_split(query: Tensor, key: Tensor, value: Tensor) -> tuple[str, ...]:
    """The GEMMs of ``nn.MultiheadAttention``'s packed in-projection for these inputs, by the
    sites each makes, as ``F._in_projection_packed`` splits them: ``("qkv",)`` for
    self-attention (one input), ``("q", "kv")`` when key is value, else ``("q", "k", "v")``."""
    if key is value:
        return ("qkv",) if query is key else ("q", "kv")
    return ("q", "k", "v")


_IN_PROJ = ("in_proj_weight", "in_proj_bias")


def _mha_projections(
    where: str, m: nn.MultiheadAttention, split: tuple[str, ...]
) -> tuple[ProjectionSpec, ...]:
    """An ``nn.MultiheadAttention``'s projections: the rows of ``in_proj_weight`` of each GEMM of
    ``split`` (:func:`mha_split`, as its first call runs them; ``checked_mha`` runs them through
    ``attention.projection.project``) and ``out_proj``. Separate Q, K and V weights (``kdim`` or
    ``vdim`` not ``embed_dim``) are not checked, with a warning."""
    nh = m.num_heads
    specs = [ProjectionSpec(SITES["out"], m.out_proj, nh)]
    if m.in_proj_weight is None:
        warnings.warn(
            f"attnchecker: {where}: its in-projection (q/k/v_proj_weight: kdim or vdim not "
            f"embed_dim) is not checked; its out_proj is",
            RuntimeWarning,
            stacklevel=3,
        )
        return tuple(specs)
    inner = [ProjectionSpec(SITES[sites], m, nh * len(sites), last=i == len(split) - 1,
                            params=_IN_PROJ) for i, sites in enumerate(split)]  # fmt: skip
    return (*inner, *specs)


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


_GEMMS = ("MmBackward", "AddmmBackward", "BmmBackward", "MvBackward", "LinearBackward")


def _feeding(t: Tensor, weights: dict[int, str], others: dict[int, str]) -> tuple[set, set]:
    """The linear layers nearest upstream of ``t`` on each path of its autograd graph, and
    what else a GEMM on a path multiplies first: a parameter of no linear layer (``F.linear``
    on a Parameter) or a constant operand (a weight that does not require gradients); such a
    path ends there, at no projection."""
    hits: dict[object, str | None] = {}
    bare: set[str] = set()

    def stop(fn) -> bool:  # at a linear layer, or a GEMM of anything else: this path ends
        hits[fn] = _linear_at(fn, weights)
        if hits[fn] is not None:
            return True
        if not type(fn).__name__.startswith(_GEMMS):
            return False
        if (p := _linear_at(fn, others)) is not None:
            bare.add(f"{p} multiplied by F.linear or by hand")
            return True
        if any(child is None for child, _ in fn.next_functions):  # no graph: no gradient
            bare.add("a weight that does not require gradients")
            return True
        return False  # two activations multiplied: walk on

    for _ in _upstream(t, _WALK, stop):
        pass
    return {h for h in hits.values() if h is not None}, bare


def _reaches(t: Tensor, target, limit: int = 60) -> bool:
    """Whether autograd node ``target`` is upstream of ``t`` within ``limit`` nodes."""
    return any(fn is target for fn in _upstream(t, limit))


def _projections(
    where: str,
    operands: tuple[Tensor, Tensor, Tensor, Tensor],
    io: dict[str, tuple[Tensor, Tensor]],
    weights: dict[int, str],
    others: dict[int, str],
    modules: dict[str, nn.Module],
) -> tuple[tuple[ProjectionSpec, ...], str]:
    """The projections of the SDPA call in ``where``: each of Q, K, V from one linear layer,
    grouped by layer; the output projection; and why none were found ("" when they were):
    with a warning when the layout is not one the checks implement."""
    q, k, v, out = operands
    if q.dim() != 4:
        return (), f"projections not found: SDPA called with {q.dim()}-D operands"
    if any(x.grad_fn is None for x in (q, k, v)):
        return (), (
            "projections not found: Q, K and V have no autograd graph (the projection "
            "weights do not require gradients)"
        )
    fed = {s: _feeding(t, weights, others) for s, t in zip("qkv", (q, k, v), strict=True)}
    sources = {s: linears for s, (linears, _) in fed.items()}
    if none := [s for s, src in sources.items() if not src]:
        bare = sorted({p for s in none for p in fed[s][1]}) or ["no GEMM found"]
        return _unknown(where, f"no nn.Linear makes {', '.join(none).upper()} ("
                               f"{'; '.join(bare)})")  # fmt: skip
    if mixed := [s for s, (linears, bare) in fed.items() if bare]:  # LoRA on a frozen base
        what = "; ".join(f"{s.upper()} by {sorted(fed[s][0])} and {sorted(fed[s][1])}"
                         for s in mixed)  # fmt: skip
        return _unknown(where, f"made by more than one nn.Linear's GEMM: {what}")
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
        interleaved, lead, trail = False, 0, 0
        if len(sites) > 1:
            layout = _layout(io[name][1], v, d, nh, sites)
            if layout is None:
                return _unknown(where, f"{name}'s outputs split into {sites} in no known layout")
            interleaved, lead, trail = layout
        wiring = Wiring(projections=(), interleaved=interleaved)
        try:
            specs.append(projection_spec(modules[name], SITES[sites], d, nh, wiring, where,
                                         lead=lead, trail=trail))  # fmt: skip
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
    return tuple(specs), ""


def _layout(y: Tensor, v: Tensor, d: int, nh: int, sites: str) -> tuple[bool, int, int] | None:
    """How a fused projection's output y (B, L, width) holds ``sites`` (``"qkv"``, or ``"kv"``):
    (interleaved, lead, trail), the last two in heads of d before and after the sites, or None.

    Read by finding V (B, Hv, L, d; K/V heads repeated by hand compared at their first copy)
    bitwise among y's heads, for each K/V head count n_kv that divides Hv (most first), in
    this order: Q | K | V contiguous over the whole output (nanoGPT, litgpt, timm's
    ``reshape(..., 3, H, D)``); interleaved per K/V group, [the nh / n_kv query heads of group
    g | k_g | v_g] (Megatron-LM, torchtitan's ``wqkv``; GPT-NeoX: one query head a group);
    Q | K | V contiguous at an offset of whole heads, features no site names around them (timm's
    ``ParallelScalingBlock``: the MLP's input first). Only V is compared: rotary embeddings and
    norms change Q and K, which are taken where the layout puts them."""
    if y.dim() != 3 or y.shape[-1] % d:
        return None
    B, L, width = y.shape
    Hv, heads = v.shape[1], width // d
    if v.shape[0] != B or v.shape[2] != L or v.shape[3] != d:
        return None
    yh = y.unflatten(-1, (heads, d)).transpose(1, 2)  # (B, heads, L, d)
    nq = nh if sites == "qkv" else 0
    counts = [n for n in range(Hv, 0, -1) if Hv % n == 0 and nq + 2 * n <= heads]
    for n in counts:  # the sites fill the output
        first = v[:, :: Hv // n]  # (B, n, L, d)
        span = nq + 2 * n
        if span != heads:
            continue
        if torch.equal(yh[:, span - n :], first):
            return False, 0, 0
        # interleaved: (B, n, span / n, L, d), V last in each K/V group
        if nq % n == 0 and torch.equal(yh.unflatten(1, (n, span // n))[:, :, -1], first):
            return True, 0, 0
    for n in counts:  # the sites at an offset
        first, span = v[:, :: Hv // n], nq + 2 * n
        for lead in range(heads - span + 1):
            if torch.equal(yh[:, lead + span - n : lead + span], first):
                return False, lead, heads - span - lead
    return None


def _unknown(where: str, why: str) -> tuple[tuple[ProjectionSpec, ...], str]:
    warnings.warn(
        f"attnchecker: {where}: its projections are not checked as attention projections "
        f"({why}); scope='all_linear' checks them as linear layers",
        RuntimeWarning,
        stacklevel=4,
    )
    return (), f"projections not found: {why}"
