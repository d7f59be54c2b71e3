"""Discovery: the attention layers of a model, found from the family table, or refused by name.

For a ``model_type`` of :data:`~attnchecker.models.families.TABLE`, its :class:`Wiring` says
which modules are attention modules (every projection path resolves to a module with a weight)
and how their projections split into sites and heads. Any other model goes through the
**generic rule**: the first interface wiring of the table whose paths fit some of its modules,
with every precaution that costs nothing in correctness (Q and K checked as soon as they are
projected, V's sums never passed to the core). Either way, before anything is installed the
family's own ``eager_attention_forward`` is run on a small probe (fp32 and bf16, an additive
mask, dropout with a fixed seed) beside the core: the table's spec must reproduce it bitwise,
and for a generic model the first candidate spec that does is taken; a model whose attention
math none reproduces is refused, naming the module. Never protect wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from attnchecker.attention.core import CoreSpec, attend
from attnchecker.attention.engines import EAGER, Engine
from attnchecker.attention.projection import ProjectionSpec, is_conv1d
from attnchecker.errors import ConfigError, UnsupportedModelError

if TYPE_CHECKING:
    from attnchecker.models.families import Wiring

__all__ = [
    "AttentionBlock",
    "Discovery",
    "ProjectionSpec",
    "TransformerBlock",
    "discover",
    "layer_of",
    "linear_by_role",
    "linear_layers",
    "projection_spec",
    "role_of",
    "transformer_blocks",
]

SITES = {"q": ("q",), "k": ("k",), "v": ("v",), "kv": ("k", "v"), "qkv": ("q", "k", "v"),
          "out": ("out",)}  # fmt: skip
"""What a projection's output holds, by the names of the family table's wiring."""
_HEAD_DIM = ("head_dim", "head_size", "attention_head_size")  # the core's attribute names
_CANDIDATES = (CoreSpec(softmax_fp32=True), CoreSpec(), CoreSpec(probs_to_value_dtype=True))


@dataclass(frozen=True)
class AttentionBlock:
    """One attention layer as protection sees it."""

    name: str  # qualified name of the module that calls the attention function
    layer: int
    core: nn.Module
    projections: tuple[ProjectionSpec, ...]
    spec: CoreSpec
    passing: bool = True  # V's projection sums may serve the context check
    unfound: str = ""  # why no projections were found (a model of one's own), or ""


@dataclass(frozen=True)
class Discovery:
    """What protection installs on a model: its blocks, and how the core is routed to them."""

    model_type: str
    blocks: list[AttentionBlock]
    wiring: Wiring
    generic: bool  # found by the generic rule, not a table entry


def discover(model: nn.Module) -> Discovery:
    """The attention blocks of ``model``; raises :class:`UnsupportedModelError` naming what was
    not understood."""
    from attnchecker.models.families import TABLE

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = ", ".join(sorted(TABLE))
    if not isinstance(model_type, str):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers model (no config.model_type); "
            f"supported families: {supported}"
        )
    if model_type in TABLE:
        wiring = TABLE[model_type].wiring
        blocks = _blocks(model, wiring)
        if not blocks:
            raise UnsupportedModelError(
                f"found no attention module of {model_type!r} with the projections "
                f"{', '.join(wiring.projections)}"
            )
        generic = False
    else:
        wiring, blocks = _generic(model, model_type, supported)
        generic = True
    if not wiring.patch and not generic:  # the table's spec, still what transformers runs?
        for b in {type(b.core): b for b in blocks}.values():
            if not probe(b.core, b.spec, b.projections):
                raise UnsupportedModelError(
                    f"the eager attention of {type(b.core).__name__} ({model_type}) no longer "
                    f"matches attnchecker's table entry for {model_type!r} bitwise (a "
                    f"transformers version it was not written for?); protect_ refuses"
                )
    return Discovery(model_type, blocks, wiring, generic)


def _generic(model: nn.Module, model_type: str, supported: str) -> tuple[Wiring, list]:
    from attnchecker.models.families import TABLE

    seen: list[Wiring] = []
    for fam in TABLE.values():
        w = fam.wiring
        if w.patch or any(s.projections == w.projections for s in seen):
            continue
        seen.append(w)
        # nothing is known about what reads Q, K and V in between: check each at once, and
        # never hand V's sums across whatever the module does to V
        safe = replace(w, read_early=("q", "k"), passing=False)
        blocks = _blocks(model, safe)
        if blocks:
            specs: dict[type, CoreSpec] = {}
            for b in blocks:
                if type(b.core) not in specs:
                    specs[type(b.core)] = _probe_spec(b, model_type)
            return safe, [replace(b, spec=specs[type(b.core)]) for b in blocks]
    layouts = "; ".join(", ".join(w.projections) for w in seen)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not in attnchecker's family table and none of its "
        f"modules has a known attention layout ({layouts}); supported families: {supported}"
    )


def _blocks(model: nn.Module, wiring: Wiring) -> list[AttentionBlock]:
    out = []
    for name, m in model.named_modules():
        cross = bool(getattr(m, "is_cross_attention", False)) and wiring.cross
        paths = [p.partition(":") for p in (wiring.cross if cross else wiring.projections)]
        mods = [_path(m, path) for path, _, _ in paths]
        core = _path(m, wiring.core) if wiring.core else m
        if core is None or any(p is None or not hasattr(p, "weight") for p in mods):
            continue
        if wiring.patch and not hasattr(core, wiring.patch[0]):
            continue
        where = f"{name}.{wiring.core}" if wiring.core else name
        d = _head_dim(core, where)
        out_mod = next(p for p, (_, _, s) in zip(mods, paths, strict=True) if s == "out")
        n_out_in = _width(out_mod, inputs=True) // d  # query heads: the output projection's input
        projections = tuple(
            projection_spec(p, SITES[s], d, n_out_in, wiring, where)
            for p, (_, _, s) in zip(mods, paths, strict=True)
        )
        layer = layer_of(where, core, len(out))
        out.append(AttentionBlock(where, layer, core, projections, wiring.spec, wiring.passing))
    return out


def projection_spec(
    m: nn.Module,
    sites: tuple[str, ...],
    d: int,
    nh: int,
    wiring: Wiring,
    where: str,
    *,
    lead: int = 0,
    trail: int = 0,
) -> ProjectionSpec:
    """The :class:`ProjectionSpec` of linear layer ``m`` holding ``sites`` of heads of size
    ``d``, ``nh`` query heads (a fused Q|K|V with fewer K/V heads split after them, or
    interleaved per K/V group), as ``wiring`` lays it out (``interleaved``, ``read_early``);
    ``lead`` / ``trail``: head groups of outputs before / after the sites that no site names
    (timm's ``ParallelScalingBlock``); ``where`` names the block in errors."""
    conv1d = is_conv1d(m)
    width = _width(m, inputs=False)
    if width % d:
        raise UnsupportedModelError(
            f"{where}: a projection of {width} outputs does not split into heads of {d}"
        )
    groups = width // d
    inner = groups - lead - trail  # the sites' head groups
    interleaved = wiring.interleaved and len(sites) > 1
    per_site: tuple[int, ...] = ()
    if sites == ("q", "k", "v") and inner != 3 * nh:  # fused Q|K|V with grouped K/V heads
        rest = inner - nh
        if rest <= 0 or rest % 2 or (interleaved and nh % (rest // 2)):
            raise UnsupportedModelError(
                f"{where}: cannot split a fused projection of {inner} heads into Q ({nh} "
                f"heads), K and V" + (" per K/V group" if interleaved else "")
            )
        per_site = (nh, rest // 2, rest // 2)
    elif inner < 0 or inner % len(sites):
        raise UnsupportedModelError(
            f"{where}: cannot split a projection of {inner} heads into {', '.join(sites)}"
        )
    last = "v" in sites or sites == ("out",) or any(s in wiring.read_early for s in sites)
    return ProjectionSpec(sites, m, groups, conv1d, last, per_site, interleaved, lead, trail)


def _probe_spec(block: AttentionBlock, model_type: str) -> CoreSpec:
    """The first candidate spec that reproduces the block's eager attention bitwise."""
    import sys

    if (
        getattr(sys.modules.get(type(block.core).__module__), "eager_attention_forward", None)
        is None
    ):
        raise UnsupportedModelError(
            f"{type(block.core).__name__} ({model_type}) does not dispatch through transformers' "
            f"AttentionInterface (its module has no eager_attention_forward)"
        )
    for spec in _CANDIDATES:
        if probe(block.core, spec, block.projections):
            return spec
    raise UnsupportedModelError(
        f"the eager attention of {type(block.core).__name__} ({model_type}) differs from every "
        f"form the checked core implements; protect_ refuses rather than change its math"
    )


def probe(core: nn.Module, spec: CoreSpec, projections: tuple[ProjectionSpec, ...]) -> bool:
    """Whether :func:`attend` under ``spec`` reproduces ``core``'s own eager attention bitwise on
    small random operands: fp32 and bf16, an additive causal mask, dropout 0.5 from one seed
    (outputs and probabilities). The global RNG is left as it was."""
    import inspect
    import sys

    eager = getattr(sys.modules.get(type(core).__module__), "eager_attention_forward", None)
    if eager is None:
        return False
    heads = {s: n for p in projections for s, n in p.heads.items()}
    nh, nkv = heads["q"], heads["k"]
    d = _head_dim(core, type(core).__name__)
    device = next(core.parameters(), torch.empty(0)).device
    g = torch.Generator(device=device).manual_seed(0)
    forked = [device.index or 0] if device.type == "cuda" else []
    # scaling=None where the eager function has that default (the core then takes 1/sqrt(d))
    default = inspect.signature(eager).parameters.get("scaling")
    cases = [(0.37, 0.0), (0.37, 0.5)]
    if default is not None and default.default is None:
        cases.append((None, 0.0))
    was = core.training
    try:
        core.train()
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(2, n, 5, d, generator=g, device=device, dtype=dtype)
                       for n in (nh, nkv, nkv))  # fmt: skip
            mask = torch.triu(torch.full((5, 5), torch.finfo(dtype).min, device=device), 1)
            mask = mask.to(dtype)[None, None].expand(2, 1, 5, 5)
            for scaling, p in cases:
                with torch.no_grad(), torch.random.fork_rng(devices=forked):
                    torch.manual_seed(1)
                    want = eager(core, q, k, v, mask, scaling=scaling, dropout=p)
                    torch.manual_seed(1)
                    s = d**-0.5 if scaling is None else scaling
                    got = attend(spec, q, k, v, mask, scaling=s, dropout=p, training=True)
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    return False
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
        return False
    finally:
        core.train(was)
    return True


def _path(m: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        m = getattr(m, part, None)
        if not isinstance(m, nn.Module):
            return None
    return m


def _head_dim(core: nn.Module, where: str) -> int:
    for a in _HEAD_DIM:
        d = getattr(core, a, None)
        if isinstance(d, int) and d > 0:
            return d
    raise UnsupportedModelError(f"{where}: no head size attribute ({', '.join(_HEAD_DIM)})")


def _width(m: nn.Module, *, inputs: bool) -> int:
    """Input or output features of a Linear / Conv1D (whose weight is stored (in, out))."""
    w = m.weight
    return w.shape[0 if inputs == is_conv1d(m) else 1] if w.dim() == 2 else 0


def layer_of(name: str, module: nn.Module | None = None, default: int = -1) -> int:
    """The transformer layer of the module called ``name``: the ``module``'s own ``layer_idx``
    (``layer_id`` in GPT-Neo) when it has one, else the first index in ``name``
    (``model.layers.3.mlp.down_proj``: 3), else ``default``. The one rule for "which layer":
    attention blocks (``default``: their position among the attention modules), the linear
    layers of ``scope="all_linear"`` and the transformer blocks of :func:`transformer_blocks`."""
    for a in ("layer_idx", "layer_id"):
        idx = getattr(module, a, None)
        if isinstance(idx, int):
            return idx
    return next((int(part) for part in name.split(".") if part.isdigit()), default)


def role_of(name: str) -> str:
    """What the module called ``name`` is inside its transformer block: the part of the name
    after the block's index (``model.layers.3.mlp.down_proj``: ``mlp.down_proj``), or the whole
    name of a module outside the blocks (``lm_head``, :func:`layer_of` -1)."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return name if i is None or i == len(parts) - 1 else ".".join(parts[i + 1 :])


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module, int, str]]:
    """Every ``nn.Linear`` / ``Conv1D`` of ``model`` as (name, module, :func:`layer_of`,
    :func:`role_of`): (layer, role) is how a schedule entry, a fault site and the controller
    name one (an encoder's and a decoder's ``fc1`` of one index share it)."""
    return [(n, m, layer_of(n, m), role_of(n)) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) or is_conv1d(m)]  # fmt: skip


def linear_by_role(
    model: nn.Module, roles: set[str]
) -> dict[tuple[int, str], tuple[str, nn.Module]]:
    """The linear layers of ``roles`` by (layer, role); raises :class:`ConfigError` when one
    (layer, role) names two (a sequence-to-sequence model's encoder and decoder layers)."""
    out: dict[tuple[int, str], tuple[str, nn.Module]] = {}
    for n, m, layer, role in linear_layers(model):
        if role not in roles:
            continue
        if (layer, role) in out:
            raise ConfigError(
                f"(layer {layer}, role {role!r}) names both {out[layer, role][0]} and {n}: "
                f"linear sites address decoder-only stacks"
            )
        out[layer, role] = (n, m)
    return out


@dataclass(frozen=True)
class TransformerBlock:
    """One transformer block: its attention and its MLP submodules (the family's
    :attr:`~attnchecker.models.families.Family.sublayers`)."""

    name: str  # qualified name of the block
    layer: int
    attention: nn.Module
    mlp: nn.Module


def transformer_blocks(model: nn.Module) -> list[TransformerBlock]:
    """Every module of ``model`` that has its family's attention and MLP children, in module
    order; a ``model_type`` not in the table takes the first pair of child names of the table
    that some of its modules have (the generic rule); [] when none does."""
    from attnchecker.models.families import TABLE

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in TABLE:
        candidates = [TABLE[model_type].sublayers]
    else:
        candidates = list(dict.fromkeys(f.sublayers for f in TABLE.values()))
    for attn, mlp in candidates:
        found = []
        for name, m in model.named_modules():
            children = dict(m.named_children())
            if attn in children and mlp in children:
                found.append(
                    TransformerBlock(name, layer_of(name, m), children[attn], children[mlp])
                )
        if found:
            return found
    return []


def install(
    model: nn.Module,
    found: Discovery,
    *,
    engine: Engine = EAGER,
    states: Sequence = (),
) -> Callable[[], None]:
    """Route every block's attention through the checked core (by ``engine``), or through the
    model's own while none of ``states`` needs the core (the attention interface's families);
    return the undo."""
    if not found.wiring.patch:
        from attnchecker.models.interface import install_interface

        cores = [b.core for b in found.blocks]
        return install_interface(model, engine=engine, cores=cores, states=states)
    method, make = found.wiring.patch
    for b in found.blocks:
        setattr(b.core, method, make(b.core))

    def undo() -> None:
        for b in found.blocks:
            delattr(b.core, method)

    return undo
