"""The projections' checks and the wiring of every checked linear layer, in one place.

A projection check, whole: a forward hook on the projection (Linear or GPT-2's Conv1D) runs its
sites, then queues the check of its output (:func:`defer`); the queued projections of one input
(Q, K and V of the same hidden states) are checked together when the last of them ran
(:func:`flush`: one :func:`~attnchecker.attention.checks.projection_check_`, which repairs in
place), and with ``mode="passing"`` what the core can reuse (V's row sums, their bound) is left
in ``state.handoff`` for :func:`~attnchecker.attention.core.attend`.

The backward: :func:`patch_backward` routes the module's forward through
:func:`~attnchecker.attention.grads.checked_linear`, whose backward checks dX and dW.
With ``scope="all_linear"``, :func:`protect_linears` does both for every other linear layer
(ops ``y``, ``dx``, ``dw``). ``attnchecker.models.protect`` finds the modules and calls these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attnchecker.abft.cast import autocast_dtype
from attnchecker.attention import kernel_checks, sharded
from attnchecker.attention.checks import Projection, projection_check_, row_limits
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.grads import checked_linear
from attnchecker.attention.handoff import Handoff
from attnchecker.attention.ops import CORE_GRAD_OPS, GRAD_OPS, LINEAR_OPS, OPS
from attnchecker.attention.ops import op as table_op
from attnchecker.attention.records import new_log, ranged
from attnchecker.attention.schedule import Schedule
from attnchecker.attention.state import AttentionState, Clock
from attnchecker.errors import UnsupportedModelError
from attnchecker.kernels import CHECKS

__all__ = [
    "ProjectionSpec",
    "defer",
    "flush",
    "is_conv1d",
    "linear_hook",
    "patch_backward",
    "project",
    "projection_hook",
    "protect_attention",
    "protect_linears",
    "settle",
]

Undo = Callable[[], None]
Spans = Callable[[int], tuple[tuple[str, int, int], ...]]
"""(site, start, stop) of each site's columns of a layer's n outputs: what the accumulator GEMM
computes and records a call each (:func:`_segments`)."""


@dataclass(frozen=True)
class ProjectionSpec:
    """A projection submodule: its sites (three for a fused Q|K|V), output groups (heads), and
    how its outputs hold the sites (:class:`~attnchecker.attention.checks.Projection`).

    ``params``: the projection is no forward of ``module`` but a packed Q|K|V Parameter of it
    that the module's attention function multiplies itself (``("in_proj_weight",
    "in_proj_bias")`` of ``nn.MultiheadAttention``), the rows of ``sites`` of it (Q, K and V
    equal parts); that function runs it through :func:`project`."""

    sites: tuple[str, ...]
    module: nn.Module
    groups: int
    conv1d: bool = False  # GPT-2's Conv1D: weight stored (in, out), y = addmm(b, x, W)
    last: bool = True  # the last projection of its input (V after Q and K): check them now
    site_groups: tuple[int, ...] = ()  # groups of each site when not equal (fused Q|K|V + GQA)
    interleaved: bool = False  # sites alternate per K/V group ([q heads of g | k_g | v_g])
    lead: int = 0  # head groups before the sites (timm's ParallelScalingBlock: the MLP input)
    trail: int = 0  # head groups after the sites
    params: tuple[str, str] = ()  # (weight, bias) attribute names of a packed Parameter

    @property
    def heads(self) -> dict[str, int]:
        """Head groups of each site."""
        return dict(zip(self.sites, self.projection().per_site, strict=True))

    @property
    def ops(self) -> tuple[str, str]:
        """Its backward GEMMs' ops: one dX and one dW GEMM, named by its first site."""
        return f"dx.{self.sites[0]}", f"dw.{self.sites[0]}"

    def projection(self) -> Projection:
        """What the check sees, with the module's parameters as they are now (read per call:
        FSDP and optimizers may replace them)."""
        m = self.module
        names = self.params or ("weight", "bias")
        weight, bias = getattr(m, names[0]), getattr(m, names[1])
        groups = self.groups
        if sharded.is_sharded(weight):  # tensor parallel: this rank's shard (attention.sharded)
            if self.params or self.conv1d or self.site_groups or self.lead or self.trail or (
                self.interleaved or len(self.sites) > 1
            ):
                raise UnsupportedModelError(
                    f"{'|'.join(self.sites)}: a tensor-parallel projection that is not one "
                    f"site's (N, K) Linear is not checked by attnchecker"
                )
            groups = sharded.local_groups(weight, groups, self.sites[0])
            weight, bias = sharded.local(weight), None if bias is None else sharded.local(bias)
        if self.params and len(self.sites) < 3:  # the sites' rows of a packed Q | K | V
            n, first = weight.shape[0] // 3, "qkv".index(self.sites[0])
            rows = slice(first * n, (first + len(self.sites)) * n)
            weight, bias = weight[rows], None if bias is None else bias[rows]
        return Projection(weight, bias, self.conv1d, self.sites, groups, self.site_groups,
                          self.interleaved, self.lead, self.trail)  # fmt: skip


def is_conv1d(m: nn.Module) -> bool:
    """Whether ``m`` is transformers' Conv1D (GPT-2: weight stored (in, out))."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(m, Conv1D)


# ------------------------------------------------------------------------------------ forward


def projection_hook(state: AttentionState, spec: ProjectionSpec) -> Callable[..., None]:
    """The forward hook of a projection: its sites on the output, then its check queued."""

    def hook(module: nn.Module, args: tuple[Tensor, ...], y: Tensor) -> None:
        x, y = sharded.local(args[0]), sharded.local(y)  # (tensor parallel: this rank's GEMM)
        _sites_and_check(state, spec, spec.projection(), x, y)

    return hook


def project(state: AttentionState, spec: ProjectionSpec, x: Tensor) -> Tensor:
    """y = x W^T + b of a projection that is no module's forward (``spec.params``:
    ``nn.MultiheadAttention``'s ``in_proj_weight``, or the rows of it of the sites), made and
    checked as a hooked projection is: ``F.linear`` (its backward checked as
    :func:`patch_backward` checks a module's), then its sites and its check."""
    proj = spec.projection()
    y = _linear(state, x, proj.weight, proj.bias, False, *spec.ops,
                lambda: F.linear(x, proj.weight, proj.bias), proj.groups)  # fmt: skip
    _sites_and_check(state, spec, proj, x, y)
    return y


def _sites_and_check(
    state: AttentionState, spec: ProjectionSpec, proj: Projection, x: Tensor, y: Tensor
) -> None:
    """Run the sites of projection output y (..., N) = proj(x), then queue its check."""
    if state.acc_out is y:  # computed and checked, its sites run, by the accumulator GEMM
        state.acc_out = None
        if state.config.mode == "passing":
            state.handoff = None  # no delivered-output sums: the core computes V's itself
        state.commit()
        return
    body = y  # the sites' outputs
    if proj.lead or proj.trail:
        w = y.shape[-1] // proj.groups
        body = y[..., proj.lead * w : y.shape[-1] - proj.trail * w]
    if proj.interleaved:  # (..., blocks, block): a site is a strided slice, edited as a copy
        n, start = proj.blocks, 0
        parts = body.view(*body.shape[:-1], n, -1)  # (not unflatten: dynamo under the mode)
        for site, width in zip(spec.sites, proj.site_widths(y.shape[-1]), strict=True):
            part = parts[..., start : start + width // n]  # (..., blocks, width / blocks)
            start += width // n
            if state.hooks[site]:
                edited = part.flatten(-2)  # (..., width): the site's heads in order
                state.site(site, edited)
                part.data.copy_(edited.view(part.shape))
    else:
        start = 0
        for site, width in zip(spec.sites, proj.site_widths(y.shape[-1]), strict=True):
            state.site(site, body[..., start : start + width])
            start += width
    if any(state.checks(s) for s in spec.sites):  # per call: the schedule switches it
        defer(state, proj, x, y, last=spec.last)


def defer(state: AttentionState, proj: Projection, x: Tensor, y: Tensor, *, last: bool) -> None:
    """Queue the check of projection output y = proj(x); ``last``: the last projection of its
    input (V after Q and K), so the queued projections of each input are checked together."""
    state.pending.append((proj, x, y))
    if last:
        flush(state)


def flush(state: AttentionState) -> None:
    """Check the queued projections, one call per input tensor (Q, K and V of one input share
    every input-side op), and leave what the core can use (``mode="passing"``)."""
    while state.pending:
        x = state.pending[0][1]
        group = [item for item in state.pending if item[1] is x]
        state.pending = [item for item in state.pending if item[1] is not x]
        _check_group(state, x, group)


def settle(state: AttentionState) -> None:
    """Check what is still queued and write every noted record (before the records are read:
    a projection whose group never completed, a layer without an output projection check)."""
    flush(state)
    state.commit()


def _check_group(
    state: AttentionState, x: Tensor, group: list[tuple[Projection, Tensor, Tensor]]
) -> None:
    flat = x.dim() != 3 or any(y.dim() != 3 for _, _, y in group)
    if flat:  # not (B, L, K) hidden states: checked as (1, T, K) tokens, nothing handed off
        lead = x.shape[:-1]
        if any(y.shape[:-1] != lead or not y.is_contiguous() for _, _, y in group):
            raise UnsupportedModelError(
                f"{state.name}: a projection of input {tuple(x.shape)} gave outputs "
                f"{[tuple(y.shape) for _, _, y in group]} that are not its tokens' rows"
            )
        x = x.reshape(1, -1, x.shape[-1])
        group = [(p, x, y.view(1, -1, y.shape[-1])) for p, _, y in group]
    pairs = [(p, y) for p, _, y in group]
    layouts = {(y.shape[-1] // p.groups, p.conv1d) for p, y in pairs}
    if len(layouts) > 1:  # groups of different widths or layouts: one check per projection
        for item in group:
            _check_group(state, x, [item])
        return
    config = state.config
    lim = row_limits(x, pairs, config.tolerance_scale)
    sites = tuple(s for p, _ in pairs for s in p.sites)
    passing = config.mode == "passing"
    checked = tuple(s for s in sites if state.checks(s))
    if kernel_checks.runs_kernels(state.impl):  # registered ops, records into the log
        with ranged("+".join(sites)):
            ref, bound = kernel_checks.check_group(state, x, pairs, checked, bounds=passing,
                                                   **lim)  # fmt: skip
    else:
        with ranged("+".join(sites)):
            rec, ref, bound = projection_check_(
                x, pairs, max_rows=config.max_rows, bounds=passing,
                how=state.impl.region(pairs[0][1].dtype), **lim,
            )  # fmt: skip
        if checked != sites:
            rec = rec[[sites.index(s) for s in checked]]
        if checked:
            state.note(checked, rec)
    if "out" in checked:
        state.commit()  # the last check of the layer
    if passing and not flat:
        _leave(state, x, pairs, ref, bound)
    elif passing:
        state.handoff = None  # the core computes V's sums itself


def _leave(
    state: AttentionState, x: Tensor, pairs: list[tuple[Projection, Tensor]], ref: Tensor,
    tol: Tensor,
) -> None:  # fmt: skip
    """Hand V's clean row sums (columns of ``ref`` (T, sum G)) and how far the delivered V's
    row sums may be from them (``tol``) to the core of this call; a group without V (Q of a
    cross-attention, the output projection) leaves nothing."""
    B, L = x.shape[:2]
    offset = 0
    for p, _ in pairs:
        offset += p.lead
        for site, width in zip(p.sites, p.per_site, strict=True):
            if site == "v" and state.checks("v") and not p.interleaved:  # V's heads contiguous
                cut = slice(offset, offset + width)
                state.handoff = Handoff(
                    ref[:, cut].view(B, L, width), tol[:, cut].view(B, L, width)
                )
            offset += width
        offset += p.trail


def linear_hook(state: AttentionState, conv1d: bool) -> Callable[..., None]:
    """Check a linear layer's output like a projection of one head group (``scope="all_linear"``):
    rows (tokens) against x . sum_o W_o + sum_o b_o, columns by range, repaired in place."""

    def hook(module: nn.Module, args: tuple[Tensor, ...], y: Tensor) -> None:
        if state.acc_out is y:  # checked (and its site run) by the accumulator GEMM
            state.acc_out = None
            state.commit()
            return
        x, y = sharded.local(args[0]), sharded.local(y)  # (tensor parallel: this rank's GEMM)
        state.site("y", y)
        if not state.checks("y") or x.dim() < 2 or not y.is_contiguous():
            return
        x3, y3 = x.reshape(1, -1, x.shape[-1]), y.view(1, -1, y.shape[-1])  # (1, T, K), (1, T, N)
        weight, bias = module.weight, module.bias
        bias = None if bias is None else sharded.local(bias)
        item = [(Projection(sharded.local(weight), bias, conv1d, ("y",), 1), y3)]
        config = state.config
        lim = row_limits(x3, item, config.tolerance_scale)
        if kernel_checks.runs_kernels(state.impl):  # registered ops, the record into the log
            with ranged(f"linear.{state.name}"):
                kernel_checks.check_group(
                    state,
                    x3,
                    item,
                    ("y",),
                    bounds=False,
                    **lim,
                )
            state.commit()  # (a checkpointing replay's scratch, if any)
            return
        with ranged(f"linear.{state.name}"):
            rec = projection_check_(
                x3, item, max_rows=config.max_rows, how=state.impl.region(y.dtype), **lim,
            )[0]  # fmt: skip
        state.note(("y",), rec)
        state.commit()

    return hook


# ----------------------------------------------------------------------------------- backward


def patch_backward(
    module: nn.Module, conv1d: bool, state: AttentionState, dx: str, dw: str, groups: int = 1,
    spans: Spans | None = None,
) -> Undo | None:  # fmt: skip
    """Route a Linear / Conv1D's forward through :func:`checked_linear`, whose backward checks
    dX (op ``dx``) and dW (op ``dw``) where the schedule checks them, and runs their sites either
    way; ``spans``: its sites' columns, for the accumulator GEMM (:func:`_spans`); returns the
    undo, or None for a module of another kind (its forward is left alone)."""
    from transformers.pytorch_utils import Conv1D

    kind = Conv1D if conv1d else nn.Linear
    if type(module).forward is not kind.forward or "forward" in vars(module):
        return None

    def forward(x: Tensor) -> Tensor:
        weight, bias = module.weight, module.bias
        if sharded.is_sharded(weight) and (conv1d or sharded.split(weight, state.name) is None):
            return kind.forward(module, x)  # replicated: the DTensor layer's own (unchecked dX)
        if sharded.is_sharded(weight):  # tensor parallel: each rank's GEMM (attention.sharded)

            def local(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
                g = sharded.local_groups(weight, groups, dx)
                return _linear(state, x, w, b, False, dx, dw, lambda: F.linear(x, w, b), g,
                               spans)  # fmt: skip

            return sharded.linear(x, weight, bias, local, state.name)
        return _linear(state, x, weight, bias, conv1d, dx, dw,
                       lambda: kind.forward(module, x), groups, spans)  # fmt: skip

    module.forward = forward
    return lambda: delattr(module, "forward")


def _linear(
    state: AttentionState, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool,
    dx: str, dw: str, plain: Callable[[], Tensor], groups: int = 1, spans: Spans | None = None,
) -> Tensor:  # fmt: skip
    """y = x W^T + b (``conv1d``: x W + b) by :func:`checked_linear` where the schedule checks
    its dX (op ``dx``) or dW (op ``dw``) or a hook waits at their sites, else by ``plain()``;
    ``groups``: its head groups (the key of the step's weight sums it shares with its forward
    check)."""
    hook = state.grad_hook()
    check = (state.checks(dx), state.checks(dw))  # per call: the schedule switches them
    sink = state.grads
    # y by the accumulator GEMM (check_impl="accumulator"), each site's columns checked in it
    n = weight.shape[-1] if conv1d else weight.shape[0]
    sites = spans(n) if spans is not None and state.impl.accumulator and x.dim() >= 2 else ()
    acc = any(state.checks(s) for s, _, _ in sites)
    if sink is None or not torch.is_grad_enabled() or not (any(check) or hook or acc):
        return plain()
    config = state.config
    ops = ((state.grad_ops.index(dx), dx), (state.grad_ops.index(dw), dw))
    refs = None  # the registered ops check them (a checkpointing replay too: the same saved
    dtype = autocast_dtype(weight)  # as the GEMM will multiply it (no cast here)
    if any(check) and kernel_checks.runs_kernels(state.impl):  # tensors in both passes)
        refs = kernel_checks.weight_refs(state.clock, weight, bias, groups, conv1d, dtype)
    segments = _segments(state, weight, conv1d, dtype, plain, sites) if acc else None
    y = checked_linear(
        x, weight, bias, sink, state.clock.count, ops=ops, check=check, conv1d=conv1d,
        max_rows=config.max_rows, scale=config.tolerance_scale, hook=hook,
        impl=state.impl, refs=refs, segments=segments,
    )  # fmt: skip
    state.acc_out = y if acc else None
    return y


def _spans(spec: ProjectionSpec | None) -> Spans | None:
    """A projection's sites as column ranges, or None where they are not (interleaved heads,
    groups before or after them, a packed Parameter): its forward stays checked on its
    delivered output; a linear layer's (``spec`` None): one site, ``y``, over every column."""
    if spec is None:
        return lambda n: (("y", 0, n),)
    if spec.interleaved or spec.lead or spec.trail or spec.params:
        return None

    def spans(n: int) -> tuple[tuple[str, int, int], ...]:
        out, start = [], 0
        for site, width in zip(spec.sites, spec.projection().site_widths(n), strict=True):
            out.append((site, start, start + width))
            start += width
        return tuple(out)

    return spans


def _segments(
    state: AttentionState, weight: Tensor, conv1d: bool, dtype: torch.dtype,
    plain: Callable[[], Tensor], sites: tuple[tuple[str, int, int], ...],
) -> tuple:  # fmt: skip
    """What :func:`checked_linear` needs to compute y by the accumulator GEMM, per site (its
    columns): its record row (the log's, or a scratch where the schedule does not record it
    now), its columns' references of W as the GEMM multiplies it (once per step), and the
    site's injection as an accumulator error (:func:`~attnchecker.attention.grads._site_delta`
    on a plain product; the sites then do not run again on the output: the forward hooks)."""
    from attnchecker.attention.grads import _site_delta
    from attnchecker.kernels.gemm_check import gemm_refs

    state.follow(weight.device)
    log = state.records.direct_log()
    hooked = [s for s, _, _ in sites if state.hooks.get(s)]
    probe = None
    if hooked and not torch.compiler.is_compiling():
        with torch.no_grad():
            probe = plain()
    out = []
    for site, start, stop in sites:
        row = state.records.direct_row(site, on=state.checks)
        rec = log[row] if row >= 0 else log.new_zeros(7)

        def make(start=start, stop=stop) -> Tensor:
            with torch.no_grad():
                w = weight.detach().to(dtype)
                return gemm_refs((w if conv1d else w.t())[:, start:stop])

        wrefs = state.clock.weights.get(("acc", conv1d, dtype, start, stop), (weight,), make)
        delta = None
        if probe is not None and site in hooked:
            runs = lambda _op, t, site=site: state.site(site, t)
            delta = _site_delta(runs, site, lambda a=start, b=stop: probe[..., a:b])
        out.append((start, stop, rec, wrefs, delta))
    return tuple(out)


# ------------------------------------------------------------------------------------- wiring


def protect_attention(
    name: str,
    layer: int,
    projections: Sequence[ProjectionSpec],
    config: ABFTConfig,
    clock: Clock,
    schedule: Schedule,
    *,
    passing: bool,
    device: torch.device,
    engine: object,
    note: str = "",
    unfound: str = "",
) -> tuple[AttentionState, list[Undo], list[nn.Module]]:
    """One attention module's state with its ``projections`` wired, forward and backward:
    (the state, the undos, the projections whose backward GEMMs are asked for but could not be
    wired). ``passing``: the family lets V's sums pass to the core (else ``mode="naive"``);
    ``engine``: what runs the core (the fused kernels: their counters, and they check the
    core's backward GEMMs themselves), ``note`` saying why;
    ``unfound``: why no projections were found, when none were. Every op the config asks for
    that is not wired is in ``state.coverage.missing`` with its reason."""
    fused = engine.counters
    if not passing:
        config = config.replace(mode="naive")
    st = AttentionState(
        name, layer, config, clock, new_log(device), schedule=schedule, backward=True,
        kernel_checks=CHECKS if fused else (),
    )  # fmt: skip
    st.coverage.engine, st.coverage.note = engine, note
    # the sites this module has: a projection's only where one was found (an SDPA caller may
    # have none: its projections are then plain linear layers)
    provided = {s for p in projections for s in p.sites}
    wired = {o for o in st.ops if table_op(o).part != "projection" or o in provided}
    wired.update(() if fused else CORE_GRAD_OPS)
    undo: list[Undo] = []
    unwired = []
    st.inline = tuple(p for p in projections if p.params)  # the attention function's own
    for p in projections:
        ops = p.ops  # a fused Q|K|V: one GEMM each
        if p.params:  # run by project(), from the module's attention function
            wired.update(ops)
            continue
        undo += [p.module.register_forward_hook(projection_hook(st, p)).remove]
        patched = patch_backward(p.module, p.conv1d, st, *ops, p.groups, _spans(p))
        if patched is not None:
            undo.append(patched)
            wired.update(ops)
        elif any(op in config.ops for op in ops) or config.schedule is not None:
            unwired.append(p.module)
            st.miss(ops, _OWN_FORWARD.format(kind=type(p.module).__name__))
    st.sites.keep(wired)
    _explain(st, projections, wired, unfound or "projections not found")
    return st, undo, unwired


_OWN_FORWARD = (
    "backward not reachable: its {kind} has a forward of its own (a subclass, a quantized "
    "layer, or a hook that replaced forward)"
)
_NO_OUT = "no output projection: no linear layer takes the attention's output in the traced forward"


def _explain(
    st: AttentionState, projections: Sequence[ProjectionSpec], wired: set[str], unfound: str
) -> None:
    """Name, in ``st.coverage.missing``, each op the schedule asks of this module on a checked
    step that is not wired: no projection makes its site (``unfound``), or its GEMM is a fused
    projection's whose first op the schedule does not ask for."""
    asked = st.schedule.ops_of(st.name, on=True)
    first = {s: p.sites[0] for p in projections for s in p.sites}  # the op a GEMM is named by
    for o in (*st.ops, *st.grad_ops):
        if o not in asked or o in wired or o in st.coverage.missing:
            continue
        site = o.partition(".")[2] or o  # dx.k -> k
        if table_op(o).part == "projection" and site not in first:
            lone = site == "out" and first  # Q, K, V found: no layer takes the output
            st.miss([o], _NO_OUT if lone else unfound)
        elif site in first and first[site] != site:
            named = o.replace(f".{site}", f".{first[site]}")
            if named not in asked:
                st.miss([o], f"one GEMM with {named} (a fused projection), which the config "
                             f"does not check")  # fmt: skip


def protect_linears(
    linears: Sequence[tuple[str, nn.Module, int, str]],
    config: ABFTConfig,
    clock: Clock,
    schedule: Schedule,
) -> tuple[dict[str, AttentionState], list[Undo], list[str]]:
    """``scope="all_linear"``: each (name, Linear / Conv1D, layer, role) gets a state of its own
    (ops ``y``, ``dx``, ``dw``: :data:`LINEAR_OPS`), checked on every step or, under a
    schedule, where its entries say; returns the states, the undos and the names of those whose
    backward could not be checked (a forward of their own)."""
    states, undo, unpatched = {}, [], []
    grad_ops = LINEAR_OPS[1:]
    for name, m, layer, role in linears:
        conv1d = is_conv1d(m)
        p = next(m.parameters(), None)
        dev = p.device if p is not None and not p.is_meta else clock.count.device  # (meta:
        # built there, materialized where the clock is: models.protect._device)
        if schedule.entries is None:  # as the config's ops say of attention: forward, backward
            backward = any(op in config.ops for op in GRAD_OPS)
            forward = any(op in config.ops for op in OPS)
            checked = ("y",) * forward + (grad_ops if backward else ())
            named = None
        else:
            backward = any(op in schedule.linear_ops(layer, role) for op in grad_ops)
            checked, named = None, role
        st = AttentionState(name, layer, config, clock, new_log(dev, 1), ops=("y",),
                            grad_ops=grad_ops, schedule=schedule, fixed_ops=checked,
                            role=named, backward=True)  # fmt: skip
        states[name] = st
        undo.append(m.register_forward_hook(linear_hook(st, conv1d)).remove)
        patched = patch_backward(m, conv1d, st, *grad_ops, spans=_spans(None))
        if patched is not None:
            undo.append(patched)
            continue
        if backward:
            unpatched.append(name)
            st.miss(grad_ops, _OWN_FORWARD.format(kind=type(m).__name__))
        st.sites.keep(("y",))
        if schedule.entries is None:
            schedule.bind(name, layer, ("y",))
    return states, undo, unpatched
