"""Any PyTorch model that calls ``F.scaled_dot_product_attention``: its attention cores checked.

``F.scaled_dot_product_attention`` is ``torch._C._nn.scaled_dot_product_attention``, which
honours :class:`torch.overrides.TorchFunctionMode`: a mode sees every call however the function
was imported, including calls inside ``sdpa_kernel(...)`` blocks, and under ``torch.compile``
it is traced into the graph. Protection enters :class:`CheckedSDPA` inside the forward of each
module that calls it (so a compiled model stays one graph) and routes the call to the checked
eager core (:func:`~attnchecker.attention.core.attend`). The mode holds no value that changes
from call to call: the module's state lives in tensors, as for the Hugging Face families.

Which modules call it, and their projections, is what one traced forward sees
(:mod:`~attnchecker.models.sdpa_trace`): on ``example=`` at ``protect_``, else on the model's
first real batch, at its first forward (:mod:`~attnchecker.models.pending`). The innermost module
around each SDPA call is protected; a module seen computing attention by hand (a product, a
softmax and a product again, no SDPA: timm with fused attention off) or running flex / flash /
varlen attention (not SDPA calls) is refused by name rather than left silently unchecked, or,
with ``strict=False``, named as unchecked. Class sources only say where to look: a module whose
source names flex attention and that runs none is protected.

``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``) calls SDPA inside
``F.multi_head_attention_forward``, whose own torch-function dispatch runs its body with the
mode off: the mode routes that function instead (:func:`checked_mha`: the same in-projection,
checked as a projection where a traced forward found it, the checked core, the module's
``out_proj``). Its inference fast path
(``torch._native_multi_head_attention``, taken without gradients in eval) is not routed.

SDPA's arguments are honoured: ``attn_mask`` (bool: True attends, or an additive float mask,
broadcast), ``is_causal`` (top-left aligned, as SDPA), ``dropout_p`` (its draw kept for the
repair), ``scale`` and ``enable_gqa``; a nested tensor or a mask with ``is_causal`` is refused
by name.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from attnchecker.attention.core import CORE, CoreSpec, attend
from attnchecker.attention.engines import EAGER, FLASH, SDPA, CoreCall, before_core, run_core
from attnchecker.attention.masks import eager_from_sdpa, keys_from_sdpa, masked_out, sdpa_4d
from attnchecker.attention.ops import op as table_op
from attnchecker.attention.projection import project
from attnchecker.attention.state import AttentionState
from attnchecker.errors import UnsupportedModelError
from attnchecker.models.sdpa_trace import Found, class_source, mha_split, trace

__all__ = [
    "SPEC",
    "CheckedSDPA",
    "Found",
    "checked_mha",
    "checked_sdpa",
    "discover_sdpa",
    "sdpa_modules",
]

SPEC = CoreSpec(transpose_out=False)
"""SDPA's math: scores scaled, softmax in the operands' dtype, output (B, H, L, d)."""

_SDPA = F.scaled_dot_product_attention


def checked_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention``'s result by the checked core bound to ``module``
    (q (..., H, L, E), k and v (..., Hkv, Lk, E)); raises
    :class:`~attnchecker.errors.UnsupportedModelError` for what it does not implement. Where
    nothing needs the core (no core op asked, no hook at a core site: ``state.needs_core()``),
    SDPA itself runs, as the model called it."""
    spec, state = getattr(module, CORE)
    if state is not None and not state.needs_core():  # the model's own call, untouched
        before_core(state)  # the projections it reads are checked first
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                     is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)  # fmt: skip
    if any(t.is_nested for t in (query, key, value)):
        raise UnsupportedModelError(
            f"{type(module).__name__} calls scaled_dot_product_attention on nested tensors, "
            f"which the checked attention does not implement; protect_ refuses"
        )
    if query.dim() != 4:
        raise UnsupportedModelError(
            f"{type(module).__name__} calls scaled_dot_product_attention with {query.dim()}-D "
            f"operands; the checked attention takes (batch, heads, length, dim)"
        )
    if attn_mask is not None and is_causal:
        raise UnsupportedModelError(
            f"{type(module).__name__} gives scaled_dot_product_attention both attn_mask and "
            f"is_causal (documented as an error; torch 2.13's CPU kernels apply both), which "
            f"the checked attention does not implement; protect_ refuses"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and (not enable_gqa or heads % kv_heads):
        raise UnsupportedModelError(
            f"{type(module).__name__}: {heads} query heads over {kv_heads} key heads "
            f"(enable_gqa={enable_gqa}); SDPA would refuse it"
        )
    Lk = key.shape[-2]
    scaling = _scaling(query, scale)
    L = query.shape[-2]
    eager = partial(eager_from_sdpa, attn_mask, is_causal, L, Lk, query.dtype, query.device)
    if state is None:  # the core's math, unchecked
        return attend(spec, query, key, value, eager(), scaling=scaling, dropout=dropout_p,
                      training=dropout_p > 0)[0]  # fmt: skip
    engine, refused = state.coverage.engine, None  # the mask in the form the engine takes
    if engine is SDPA:
        mask = sdpa_4d(attn_mask)
    elif engine is FLASH:
        mask, refused = keys_from_sdpa(attn_mask, query.shape[0], Lk)
        if is_causal and Lk != L:
            refused = "is_causal with fewer queries than keys (SDPA aligns it top-left)"
    else:
        mask = eager()
    call = CoreCall(spec, query, key, value, mask, eager, scaling, dropout_p, dropout_p > 0,
                    causal=is_causal, refused=refused)  # fmt: skip
    return run_core(engine, state, call)[0]


def _scaling(query: Tensor, scale: float | None) -> float:
    """SDPA's scale: ``scale``, or 1 / sqrt(head size)."""
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _eager(spec, query, key, value, attn_mask, is_causal, scaling) -> Tensor:
    """The checked eager core's math on SDPA's arguments, unchecked (no dropout)."""
    L, Lk = query.shape[-2], key.shape[-2]
    mask = eager_from_sdpa(attn_mask, is_causal, L, Lk, query.dtype, query.device)
    return attend(spec, query, key, value, mask, scaling=scaling, dropout=0.0, training=False)[0]


PROBE_ULPS = 64
"""The probe's tolerance: the core's output may differ from SDPA's by this many units of the
dtype's rounding times the largest |v| (two orders of summation of the same products; an
argument read wrongly, a mask's polarity or a scale, differs by orders more)."""


def probe(calls: dict[str, tuple[tuple[Tensor, ...], dict, Tensor]]) -> list[str]:
    """Each recorded SDPA call (:attr:`~.sdpa_trace.Found.calls`) run by the checked core's
    math: ``name: what differed`` for each whose output is not SDPA's own within
    :data:`PROBE_ULPS` (calls with dropout are random and not compared)."""
    bad = []
    for name, ((q, k, v), kw, want) in calls.items():
        if kw.get("dropout_p", 0.0) or q.dim() != 4 or q.is_nested or q.is_meta:
            continue  # (a meta example, as torchtitan builds models, has no values to compare)
        scaling = _scaling(q, kw.get("scale"))
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads != kv_heads and (not kw.get("enable_gqa") or heads % kv_heads):
            continue  # refused by checked_sdpa at the first call, by name
        with torch.no_grad():
            got = _eager(SPEC, q, k, v, kw.get("attn_mask"), bool(kw.get("is_causal", False)),
                         scaling)  # fmt: skip
        tol = PROBE_ULPS * torch.finfo(want.dtype).eps * max(1.0, float(v.abs().max()))
        diff = (got.float() - want.float()).abs()
        same_nan = got.isnan() == want.isnan()
        worst = float(diff.nan_to_num(0.0).max()) if diff.numel() else 0.0
        if not bool(same_nan.all()) or worst > tol:
            bad.append(f"{name}: the checked core's output differs from SDPA's by up to "
                       f"{worst:.3g} (tolerance {tol:.3g}; NaN where SDPA has none: "
                       f"{int((~same_nan).sum())})")  # fmt: skip
    return bad


def checked_mha(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    training: bool = True,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    static_k: Tensor | None = None,
    static_v: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``F.multi_head_attention_forward`` (as ``nn.MultiheadAttention`` calls it: query (L, N,
    E), key and value (S, N, E)) with its attention by the checked core bound to ``module``
    and its output projection by ``module.out_proj``. Where a traced forward found the
    projections (``example=``), the in-projection's GEMMs (rows of ``in_proj_weight``, a
    Parameter, not a linear layer) run through :func:`_in_projection`, checked as a projection's
    (sites ``q``, ``k``, ``v``, ``dx.q``, ``dw.q``), and ``out_proj`` as the output projection;
    otherwise the in-projection is not checked and ``out_proj`` only with
    ``scope="all_linear"``. Masks as
    ``nn.MultiheadAttention`` reads them (a boolean True masks out), weights averaged over the
    heads when asked."""
    if query.dim() != 3 or any(x is not None for x in (bias_k, bias_v, static_k, static_v)):
        raise UnsupportedModelError(
            f"{type(module).__name__}: the checked attention implements batched inputs without "
            f"bias_k / bias_v / static keys; protect_ refuses"
        )
    if add_zero_attn:
        raise UnsupportedModelError(f"{type(module).__name__}: add_zero_attn is not implemented")
    L, N, E = query.shape
    S, hd = key.shape[0], E // num_heads
    spec, state = getattr(module, CORE)
    if use_separate_proj_weight:
        b_q, b_k, b_v = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = (F.linear(x, w, b) for x, w, b in ((query, q_proj_weight, b_q),
                   (key, k_proj_weight, b_k), (value, v_proj_weight, b_v)))  # fmt: skip
    else:
        q, k, v = _in_projection(module, state, query, key, value, in_proj_weight, in_proj_bias)
    q = q.view(L, N * num_heads, hd).transpose(0, 1).view(N, num_heads, L, hd)
    k, v = (t.view(S, N * num_heads, hd).transpose(0, 1).view(N, num_heads, S, hd) for t in (k, v))
    mask = masked_out(attn_mask, q.dtype)
    if mask is not None:
        mask = mask.view(1, 1, L, S) if mask.dim() == 2 else mask.view(N, num_heads, L, S)
    elif is_causal:
        mask = eager_from_sdpa(None, True, L, S, q.dtype, q.device)
    padding = masked_out(key_padding_mask, q.dtype)
    if padding is not None:
        padding = padding.view(N, 1, 1, S)
        mask = padding if mask is None else mask + padding
    p = dropout_p if training else 0.0
    if state is None:
        out, probs = attend(spec, q, k, v, mask, scaling=hd**-0.5, dropout=p, training=training)
    else:
        call = CoreCall(spec, q, k, v, mask, lambda: mask, hd**-0.5, p, training)
        out, probs = run_core(EAGER, state, call)
    out = out.permute(2, 0, 1, 3).reshape(L, N, E)
    proj = getattr(module, "out_proj", None)
    if proj is not None and proj.weight is out_proj_weight and proj.bias is out_proj_bias:
        out = proj(out)
    else:
        out = F.linear(out, out_proj_weight, out_proj_bias)
    if not need_weights:
        return out, None
    return out, probs.mean(1) if average_attn_weights else probs


def _in_projection(
    module: nn.Module,
    state: AttentionState | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    weight: Tensor,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``F._in_projection_packed``'s q, k, v (L or S, N, E): each GEMM by
    :func:`~attnchecker.attention.projection.project` (checked as a projection, forward and
    backward) where the traced forward found the module's in-projection with this split, the
    same ops in the same layouts; as it is, unchecked, where it did not (no ``example=``)."""
    split = mha_split(query, key, value)
    specs = {} if state is None else {"".join(p.sites): p for p in state.inline}
    if not specs or any(s not in specs for s in split) or weight is not module.in_proj_weight:
        if specs and not torch.compiler.is_compiling():
            ops = [o for p in specs.values() for o in (*p.sites, *p.ops)]
            state.miss(ops, f"the in-projection called as {split}, not as traced")
            warnings.warn(
                f"attnchecker: {state.name}: its in-projection is called as {split}, not as "
                f"the traced forward found it ({tuple(specs)}): NOT checked",
                RuntimeWarning,
                stacklevel=4,
            )
        return F._in_projection_packed(query, key, value, weight, bias)
    inputs = {"q": query, "k": key, "v": value}
    out: list[Tensor] = []
    for sites in split:
        y = project(state, specs[sites], inputs[sites[0]])  # (L or S, N, len(sites) E)
        if len(sites) == 1:
            out.append(y)
            continue
        E = query.shape[-1]  # (len(sites), L, N, E), made contiguous as PyTorch does
        y = y.unflatten(-1, (len(sites), E)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        y = y.contiguous()
        out += [y[i] for i in range(len(sites))]
    q, k, v = out
    return q, k, v


_ROUTES = {_SDPA: checked_sdpa, F.multi_head_attention_forward: checked_mha}


class CheckedSDPA(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :func:`checked_sdpa` and
    ``F.multi_head_attention_forward`` (whose own SDPA call a mode cannot see: it runs its body
    with the mode off) to :func:`checked_mha`, for ``module``; every other function runs as it
    is. One instance per module, entered in its forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.routed = 0  # calls routed in eager (never counted in a compiled graph)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is None:
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling():
            self.routed += 1
        return route(self.module, *args, **kwargs)


def wrap_forward(module: nn.Module) -> Callable[..., object]:
    """The module's forward run inside its :class:`CheckedSDPA` (for ``Wiring.patch``). A
    module whose eager forward then calls no SDPA (a code path other than the traced
    forward's) is warned about once, and its summary names the core's ops as unchecked."""
    mode, forward, warned = CheckedSDPA(module), type(module).forward, []

    def checked_forward(*args: object, **kwargs: object) -> object:
        before = mode.routed
        with mode:
            out = forward(module, *args, **kwargs)
        if mode.routed == before and not warned and not torch.compiler.is_compiling():
            warned.append(True)
            _, state = getattr(module, CORE, (None, None))
            why = "a forward ran without calling scaled_dot_product_attention"
            if state is not None:
                core = [o for o in (*state.ops, *state.grad_ops) if table_op(o).part == "core"]
                state.miss(core, why)
            warnings.warn(
                f"attnchecker: {type(module).__name__} ran without calling "
                f"scaled_dot_product_attention (a code path the traced forward did not take): "
                f"its attention is NOT checked in such calls",
                RuntimeWarning,
                stacklevel=2,
            )
        return out

    return checked_forward


def sdpa_modules(model: nn.Module, example: tuple | dict | None = None) -> Found:
    """Where ``model`` calls attention: by one traced forward on ``example`` (positional
    arguments, or keyword arguments as a dict: :func:`~.sdpa_trace.trace`, which also finds
    the projections), else where to look: the innermost modules whose class source names
    SDPA, and ``nn.MultiheadAttention`` modules (nothing seen running)."""
    if example is not None:
        return trace(model, example)
    sdpa = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
        or "scaled_dot_product_attention" in class_source(type(m))
    ]
    inner = [n for n in sdpa if not any(o != n and o.startswith(f"{n}.") for o in sdpa)]
    return Found(tuple(inner), ())


def discover_sdpa(model: nn.Module, found: Found, why: str, *, strict: bool = True):
    """The :class:`~attnchecker.models.registry.Discovery` of a model outside the family table
    (``why``: what the table said) from what a traced forward ``found``, and what it leaves
    unchecked (None, or with ``strict=False`` the attention it cannot route, named); raises
    :class:`~attnchecker.errors.UnsupportedModelError` naming attention it cannot route
    (``strict``), or when there is no SDPA call at all."""
    from attnchecker.models.families import Wiring
    from attnchecker.models.registry import AttentionBlock, Discovery, layer_of

    refused = []
    if found.unrouted:
        refused.append(
            f"{type(model).__name__} calls attention that is not scaled_dot_product_attention "
            f"in {', '.join(found.unrouted)}; protect_ cannot route it to the checked core"
        )
    if found.handwritten:
        refused.append(
            f"{type(model).__name__} computes attention by hand (a product, a softmax and a "
            f"product, no scaled_dot_product_attention) in {', '.join(found.handwritten)}; "
            f"protect_ checks SDPA calls only"
        )
    if refused and (strict or not found.sdpa):
        raise UnsupportedModelError(
            "; ".join(refused)
            + " and refuses rather than leave it unchecked"
            + (" (ABFTConfig(strict=False) protects the rest)" if found.sdpa else "")
        )
    if not found.sdpa:
        raise UnsupportedModelError(
            f"{why}; and it calls no scaled_dot_product_attention in a forward"
        )
    if differ := probe(found.calls):
        raise UnsupportedModelError(
            f"{type(model).__name__}: on the example, {'; '.join(differ)}: protect_ refuses "
            f"rather than change the model's attention"
        )
    modules = dict(model.named_modules())
    blocks = []
    for i, n in enumerate(found.sdpa):
        m, projections = modules[n], found.projections.get(n, ())
        blocks.append(AttentionBlock(n, layer_of(n, m, i), m, projections, SPEC, passing=False,
                                     unfound=found.unfound.get(n, "")))  # fmt: skip
    wiring = Wiring(projections=(), spec=SPEC, patch=("forward", wrap_forward), sdpa=True)
    left = "; ".join(refused) + " (strict=False: NOT checked)" if refused else None
    if found.unseen:  # named, not refused: nothing was seen running
        unseen = (
            f"{', '.join(found.unseen)} name an attention function that is not "
            f"scaled_dot_product_attention and ran without calling one that protect_ saw: if "
            f"they compute attention another way, it is NOT checked"
        )
        left = unseen if left is None else f"{left}; {unseen}"
    return Discovery(type(model).__name__, blocks, wiring, generic=True), left
