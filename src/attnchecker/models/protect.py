"""``protect_`` and ``unprotect_``: one call to check a model's attention, one to undo it.

Protection wraps, it does not copy: forward hooks on the projection submodules check and repair
their outputs, and the attention core is routed through :func:`attnchecker.attention.core.attend`.
No parameter, buffer or module is added or replaced, so ``state_dict()`` is unchanged and
``unprotect_`` restores the model exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from attnchecker.abft.tolerance import reduced_reductions, tf32_enabled
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.core import CORE
from attnchecker.attention.engines import Engine, choose_engine
from attnchecker.attention.ops import linear_parts
from attnchecker.attention.projection import protect_attention, protect_linears
from attnchecker.attention.schedule import Schedule
from attnchecker.attention.state import AttentionState, Clock
from attnchecker.errors import ConfigError, NoMatchingModuleError, UnsupportedModelError
from attnchecker.models.handle import ProtectionHandle
from attnchecker.models.pending import Call, defer
from attnchecker.models.registry import AttentionBlock, Discovery, discover, install, linear_layers
from attnchecker.models.sdpa import discover_sdpa
from attnchecker.models.sdpa_trace import trace, trace_call

__all__ = ["protect_", "unprotect_"]

_HANDLE = "_attnchecker_handle"


def protect_(
    model: nn.Module, config: ABFTConfig | None = None, *, example: tuple | dict | None = None
) -> ProtectionHandle:
    """Protect every attention layer of ``model`` in place: a supported Hugging Face model by
    the family table, any other PyTorch model at its ``F.scaled_dot_product_attention`` calls
    (:mod:`attnchecker.models.sdpa`), found with their projections by one traced forward: on
    ``example`` (positional arguments, or a dict of keyword arguments) now, else on the first
    real batch, at the model's first forward (:mod:`attnchecker.models.pending`: until then
    ``summary()`` says discovery is pending; what protect_ would raise here, that forward
    raises, in the same words).

    Raises :class:`~attnchecker.errors.UnsupportedModelError` for a model whose attention it
    cannot check (hand-written attention is named) and
    :class:`~attnchecker.errors.NoMatchingModuleError` when ``config.layers`` selects nothing.
    With ``scope="all_linear"``, a model whose attention protect_ cannot find has its linear
    layers checked, with a warning that names why its attention is not;
    ``handle.summary()["attention"]`` says the same.
    """
    config = ABFTConfig() if config is None else config
    if not isinstance(config, ABFTConfig):
        raise ConfigError(f"config must be an ABFTConfig, got {type(config).__name__}")
    if getattr(model, _HANDLE, None) is not None:
        raise ConfigError(
            "the model is already protected; call attnchecker.unprotect_(model) first"
        )
    tf32_enabled()  # read here, in eager code: compiled checks use the last read
    clock = Clock(torch.zeros(1, dtype=torch.float64, device=_device(model)))
    handle = ProtectionHandle(config, {}, clock, Schedule.of(config), undo=[])
    family, why = _family(model)
    if family is None and example is None:
        defer(model, handle, lambda call: _protect(model, handle, why, call))
    else:
        _protect(model, handle, family or why, example)
    if "norm" in config.invariants:
        from attnchecker.models.norms import NormCheck

        norms = NormCheck(model, max_rows=config.max_rows, scale=config.tolerance_scale,
                          device=clock.count.device,
                          kernels=config.check_impl == "triton")  # fmt: skip
        handle.invariants.append(norms)
        handle._undo += norms.undo
        if norms.unchecked:
            warnings.warn(
                f"attnchecker: {len(norms.unchecked)} norm module(s) not checked: "
                + "; ".join(f"{n} ({why})" for n, why in norms.unchecked.items()),
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
    setattr(model, _HANDLE, handle)
    handle._undo.append(lambda: delattr(model, _HANDLE))
    return handle


def _family(model: nn.Module) -> tuple[Discovery | None, str]:
    """The family table's discovery of ``model``, or (None, what the table said) for a model
    of one's own (not a transformers model); a transformers model the table refuses raises
    its reason."""
    try:
        return discover(model), ""
    except UnsupportedModelError as e:
        if isinstance(getattr(getattr(model, "config", None), "model_type", None), str):
            raise
        return None, str(e)


def _protect(
    model: nn.Module,
    handle: ProtectionHandle,
    family: Discovery | str,
    example: tuple | dict | Call | None,
) -> Callable[..., None]:
    """Wire protection into ``model`` and ``handle``: the ``family``'s blocks, or (what the
    family table said of a model of one's own) those a forward traced on ``example`` finds
    (at the first forward, a :class:`~attnchecker.models.pending.Call`);
    returns the clock's tick, installed as a root forward pre-hook. Nothing half-installed is
    left behind on an error."""
    config, clock, schedule, states = handle.config, handle._clock, handle.schedule, handle._states
    try:
        if isinstance(family, Discovery):
            found, left = family, None
        else:
            found, left = _traced(model, example, family, config.strict)
        unprotected = None
    except UnsupportedModelError as e:
        if config.scope != "all_linear":
            raise
        (found, left), unprotected = (None, None), str(e)  # its linear layers alone checked
        if config.layers is not None or config.schedule is not None:
            raise ConfigError(
                f"layers and a schedule select attention layers, and protect_ finds none in "
                f"this model ({unprotected}); use scope='all_linear' without them"
            ) from e
    chosen = [] if found is None else _chosen(found.blocks, config)
    device = _device(model)
    engine, note = choose_engine(  # backend="triton" without attention is refused by name
        config, device, family=type(model).__name__ if found is None else found.model_type,
        interface=found is not None and (not found.wiring.patch or found.wiring.sdpa),
    )  # fmt: skip
    undo: list[Callable[[], None]] = []
    try:
        unpatched = _wire(model, found, chosen, config, clock, schedule, engine, note, states, undo)
        if found is not None:
            undo.append(install(model, found, engine=engine, states=tuple(states.values())))
        elif not states:
            raise UnsupportedModelError(f"{unprotected}; and it has no linear layer to check")

        def tick(module: nn.Module, *_: object) -> None:
            device = _device(module, clock.count.device)
            if clock.count.device != device:  # moved after protect_ (a guard, not a sync)
                for state in states.values():
                    state.follow(device)
                for inv in handle.invariants:
                    inv.follow(device)
            if handle.invariants and not torch.compiler.is_compiling():
                handle.settle()  # an update check's repair, before this forward reads weights
            clock.tick(device)

        undo.append(model.register_forward_pre_hook(tick).remove)
    except BaseException:  # nothing half-installed is left behind
        for fn in reversed(undo):
            fn()
        states.clear()
        raise
    if unprotected is not None:
        warnings.warn(
            f"attnchecker: scope='all_linear' checks the {len(states)} linear layer(s) of "
            f"{type(model).__name__}, not its attention: {unprotected}",
            RuntimeWarning,
            stacklevel=3,
        )
    if left is not None:
        warnings.warn(f"attnchecker: {left}", RuntimeWarning, stacklevel=3)
    running = any(st.impl.accumulator for st in states.values())
    if config.check_impl == "accumulator" and not running:
        warnings.warn(
            "attnchecker: check_impl='accumulator' needs the Triton kernels (CUDA, or Triton's "
            "interpreter): the GEMM checks run on the delivered outputs instead "
            "(summary()['accumulator'])",
            RuntimeWarning,
            stacklevel=3,
        )
    loose = reduced_reductions() if _device(model).type == "cuda" else []
    if loose:
        warnings.warn(
            f"attnchecker: cuBLAS may reduce {'/'.join(loose)} GEMMs' split-K partials in "
            f"their own precision (torch.backends.cuda.matmul.allow_{loose[0]}_reduced_precision_"
            f"reduction): their checks see extreme errors only; set it False for checks that "
            f"see errors from ~0.01 of a row (attnchecker.abft.tolerance.gemm_terms)",
            RuntimeWarning,
            stacklevel=3,
        )
    if unpatched:
        warnings.warn(
            f"attnchecker: {len(unpatched)} linear layer(s) have a forward of their own (a "
            f"subclass, a quantized layer, or a hook that replaced forward, e.g. accelerate's): "
            f"their backward GEMMs (dx, dw) are not checked: {', '.join(unpatched)}; "
            f"handle.summary()['per_module'] lists what is checked where",
            RuntimeWarning,
            stacklevel=3,
        )
    handle._undo += undo
    handle.unprotected = unprotected or left
    return tick


def _traced(
    model: nn.Module, example: tuple | dict | Call, why: str, strict: bool
) -> tuple[Discovery, str | None]:
    """The SDPA calls' discovery of a model of one's own (``why``: what the family table
    said) by a forward traced on ``example`` (a :class:`~attnchecker.models.pending.Call` at
    the first forward), and the attention it leaves unchecked."""
    if isinstance(example, Call):
        found = trace_call(model, example.args, example.kwargs)
    else:
        found = trace(model, example)
    return discover_sdpa(model, found, why, strict=strict)


def _chosen(blocks: list[AttentionBlock], config: ABFTConfig) -> list[AttentionBlock]:
    """The blocks ``config.layers`` selects; a schedule's layers must all exist."""
    layers = config.layers  # a schedule wires every layer: its sites stay addressable
    chosen = [b for b in blocks if layers is None or b.layer in layers]
    if not chosen:
        raise NoMatchingModuleError(
            f"layers={layers} selects none of the {len(blocks)} attention layers "
            f"(indices {sorted(b.layer for b in blocks)})"
        )
    if config.schedule is not None:
        have = {b.layer for b in blocks}
        named = {layer for layer, op, _ in config.schedule if linear_parts(op) is None}
        if missing := sorted(named - have):
            raise NoMatchingModuleError(
                f"the schedule names layers {missing}; the model's attention layers are "
                f"{sorted(have)}"
            )
    return chosen


def _wire(
    model: nn.Module,
    found: Discovery | None,
    chosen: list[AttentionBlock],
    config: ABFTConfig,
    clock: Clock,
    schedule: Schedule,
    engine: Engine,
    note: str,
    states: dict[str, AttentionState],
    undo: list[Callable[[], None]],
) -> list[str]:
    """The states of the chosen attention blocks (and with ``scope="all_linear"`` of every
    other linear layer), wired, into ``states`` and their undos into ``undo``; returns the
    names of the linear layers whose backward GEMMs could not be wired."""
    device = clock.count.device
    names = {id(m): n for n, m in model.named_modules()}
    unpatched: list[str] = []  # Linear / Conv1D whose own forward replaced: no backward checks
    for b in chosen:
        st, more, unwired = protect_attention(
            b.name, b.layer, b.projections, config, clock, schedule, passing=b.passing,
            device=_device(b.core, device), engine=engine, note=note, unfound=b.unfound,
        )  # fmt: skip
        states[b.name] = st
        undo += more
        unpatched += [names.get(id(m), "?") for m in unwired]
    blocks = [] if found is None else found.blocks  # None: no attention protect_ knows
    for b in blocks:
        setattr(b.core, CORE, (b.spec, states.get(b.name)))
    undo.append(lambda: [delattr(b.core, CORE) for b in blocks if hasattr(b.core, CORE)])
    if config.scope == "all_linear":
        taken = {id(p.module) for b in chosen for p in b.projections}
        linears = [lin for lin in linear_layers(model) if id(lin[1]) not in taken]
        if config.schedule is not None:  # only the linear layers its entries name
            linears = _scheduled(linears, config.schedule)
        more_states, more, names_unpatched = protect_linears(linears, config, clock, schedule)
        states.update(more_states)
        undo += more
        unpatched += names_unpatched
    return unpatched


def _scheduled(linears: list, schedule) -> list:
    """The ``(name, module, layer, role)`` whose (layer, role) a schedule entry names; an entry
    that names none is an error that lists what there is."""
    wanted = {(layer, parts[0]) for layer, op, _ in schedule if (parts := linear_parts(op))}
    have = {(layer, role) for _, _, layer, role in linears}
    if missing := sorted(wanted - have):
        roles = sorted({role for _, role in have})
        raise NoMatchingModuleError(
            f"the schedule names linear layers {missing} (layer, role); this model's linear "
            f"layers outside attention have the roles {roles} (layers "
            f"{sorted({layer for layer, _ in have})})"
        )
    return [lin for lin in linears if (lin[2], lin[3]) in wanted]


def _device(module: nn.Module, default: torch.device | None = None) -> torch.device:
    """Where ``module``'s parameters are; a model built on the meta device (torchtitan builds
    it there, protects it, then materializes it on its accelerator) is placed where it will
    be materialized: the current CUDA device when there is one, else the CPU."""
    p = next(module.parameters(), None)
    device = p.device if p is not None else (default or torch.device("cpu"))
    if device.type == "meta":
        cuda = torch.cuda.is_available()
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device


def unprotect_(model: nn.Module) -> None:
    """Remove protection: hooks, patches and attributes; the model is as it was."""
    handle = getattr(model, _HANDLE, None)
    if handle is None:
        raise ConfigError("the model is not protected")
    handle._remove()
