"""torch.compile of a protected model (CPU inductor): it compiles once, without graph breaks,
and a fault at any op is corrected in the compiled program exactly as in eager, never crashing it.

Compiling takes tens of seconds on two cores, so one family runs by default and the others are
``slow``. Dropout draws different random numbers compiled and eager, so the reference of a
faulty compiled step is the clean compiled step from the same weights. The backward's checks
compile with the rest (one compilation, no graph break, no false alarm); faults in backward GEMMs
are injected in eager only (compiled backward graphs run no Python hooks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from attnchecker import protect_
from attnchecker.models.tiny import build
from attnchecker.testing import inductor_kernels

from .helpers import SITES, batch, fire_once, max_diff, update_excess

# one fault per site, varied so that every kind and pattern meets the compiled program once
FAULTS = dict(
    zip(
        SITES,
        [("nan", "1R"), ("inf", "1C"), ("-inf", "2D"), ("1e10", "0D"), ("nan", "2D"),
         ("-inf", "1C"), ("inf", "2D")],
        strict=True,
    )
)  # fmt: skip


def _compiled_step(model, compiled, inputs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1234)
    loss = compiled(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, params


SLOW = [pytest.mark.slow, pytest.mark.timeout(900)]
# Kernels one compiled training step calls (inductor's output code: its fused kernels, GEMMs and
# aten fallbacks; ``attnchecker.testing.inductor_kernels``), one layer, the default config: a
# count, so a change that adds kernels must say so here. Measured 2026-12-03 in this test: gpt2
# 101, llama 136, bert 132 (2026-12-02, before the backward's records joined its check regions:
# 126 / 187 / 183); the plain SDPA model of the same batch 38 / 49 / 51 (2.7x, 2.8x, 2.6x;
# ``benchmarks/protect_vs_sdpa.py --compile compiled`` reports them per arm); issue 23's target
# is 1.5x: most of the rest are the checks' matrix-vector products (library GEMV calls).
KERNELS_CEILING = {"gpt2": 105, "llama": 140, "bert": 136}
# the same count for gpt2's compiled step under bf16 autocast (no dropout), in the default run:
# measured 2026-12-03: 100 (49 generated, 39 extern calls, 12 aten fallbacks) against 40 for the
# plain SDPA model (2.5x)
BF16_KERNELS_CEILING = 104
# each faulty site is a recompilation (its hook is traced into the graph, ~60 s on 2 cores): a
# projection's repair in llama in the default run (the core's repair compiled is
# tests/integration/test_schedule.py's compiled test), every site in the slow ones


@pytest.mark.parametrize(
    ("family", "sites", "fullgraph"),
    [("llama", (), True),  # GQA, and the eager engine traced whole (fullgraph=True)
     pytest.param("llama", ("v",), True, marks=SLOW),  # a projection's fault: a recompilation
     # fused Q|K|V (Conv1D): the bf16 test below and test_schedule.py compile gpt2 by default
     pytest.param("gpt2", (), False, marks=SLOW),
     pytest.param("bert", ("scores",), False, marks=SLOW),  # an encoder (45 s: the slow set)
     pytest.param("gpt2", tuple(FAULTS), False, marks=SLOW),
     *(pytest.param(f, tuple(FAULTS), False, marks=SLOW)
       for f in ("llama", "bert", "qwen3", "gpt_neox", "opt", "bart"))],
)  # fmt: skip
def test_compiled_protected_model_compiles_once_and_corrects_every_op(family, sites, fullgraph):
    """The default config (forward and backward checks) compiled; the default run covers a GQA
    family under fullgraph=True (gpt2's fused Q|K|V compiles by default in the bf16 test below,
    with its kernel count; an encoder, BERT, and the other families are in the slow set)."""
    torch._dynamo.reset()
    counters.clear()
    model = build(family, layers=1)
    model.train()
    handle = protect_(model)
    compiled = torch.compile(model, fullgraph=fullgraph)
    inputs = batch(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frames = []
    with inductor_kernels() as kernels:  # the first step compiles: its kernels are counted
        compiled(**inputs).loss.backward()
    opt.step()
    opt.zero_grad()
    assert handle.drain() == []
    frames.append(counters["frames"]["total"])
    print(f"{family}: {kernels.total} kernels per step {dict(kernels)}")
    if family in KERNELS_CEILING:
        assert kernels.total <= KERNELS_CEILING[family], dict(kernels)
    for _ in range(3):  # clean training: no further compilation
        compiled(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
        assert handle.drain() == []
        frames.append(counters["frames"]["total"])
    assert frames[1:] == frames[:1] * 3, f"recompiled: {frames}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert handle.step == 4

    _every_fault_corrected(model, compiled, handle, inputs, sites)


def _every_fault_corrected(model, compiled, handle, inputs, sites) -> None:
    """Each site's fault of :data:`FAULTS` in a compiled step (from the same weights each time):
    the step equals the clean compiled one and the site's event says corrected or recomputed."""
    snapshot = copy.deepcopy(model.state_dict())
    want = _compiled_step(model, compiled, inputs)
    assert handle.drain() == []
    for site in sites:
        kind, pattern = FAULTS[site]
        model.load_state_dict(snapshot)
        hook = fire_once(site, pattern, kind, layer=0)
        detach = handle.attach(hook)
        got = _compiled_step(model, compiled, inputs)
        detach.remove()
        events = [(e.op, e.action) for e in handle.drain() if e.op == site]
        assert hook.fired, site
        assert torch.allclose(got[0], want[0], rtol=1e-6), (site, kind, pattern)
        assert max_diff(got[1], want[1]) <= 1e-5, (site, kind, pattern)
        assert update_excess(got, want) <= 1e-5, (site, kind, pattern)
        assert events in ([(site, "corrected")], [(site, "recomputed")]), (site, events)


def test_compiled_training_under_bf16_autocast_with_backward_checks():
    """A clean compiled step of the default config under bf16 autocast, what users run on GPUs:
    no crash, no alarm, and the loss and gradients of the eager bf16 step (to bf16 rounding).
    Found broken 2026-12-02: a layout query on a gradient inside autocast(enabled=False) in a
    backward check left autocast off for the rest of dynamo's trace, so the output projection
    multiplied an fp32 weight with bf16 activations (``abft.gemm.gemm_check_`` now reads layouts
    first)."""
    torch._dynamo.reset()
    model = build("gpt2", layers=1)
    model.train()
    handle = protect_(model)
    inputs = batch("gpt2")

    def step(fn):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(**inputs).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.detach().float(), grads

    model.eval()  # no dropout: eager and compiled draw different random numbers
    want_loss, want = step(model)
    with inductor_kernels() as kernels:
        got_loss, got = step(torch.compile(model))
    assert handle.drain() == []
    print(f"gpt2 bf16: {kernels.total} kernels per step {dict(kernels)}")
    assert kernels.total <= BF16_KERNELS_CEILING, dict(kernels)
    # to bf16 rounding: compiled and eager fuse and order the bf16 ops differently; the loss
    # within one bf16 unit roundoff (2^-8, relative; measured 3.4e-6), each gradient within 4
    # of its largest element (measured 0.75% of it, ~2 units)
    u = 2.0**-8
    assert torch.allclose(got_loss, want_loss, rtol=u, atol=0), (got_loss, want_loss)
    worst = {}
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        scale = want[name].abs().max().clamp_min(1e-6)
        worst[name] = float((g - want[name]).abs().max() / scale)
    print(
        f"gpt2 bf16 compiled vs eager: loss {abs(float(got_loss / want_loss) - 1):.2e}, "
        f"gradients up to {max(worst.values()):.2%} of their max"
    )
    assert max(worst.values()) <= 4 * u, worst


# Issue 54: a user's torch.compile of the default config as CUDA runs it (the SDPA route, the
# checks as registered Triton ops, in the interpreter here) keeps the ops, one extern call each,
# instead of tracing their torch reference inline. Inductor's kernel calls a step, one layer,
# protected minus plain: 64 with the reference inlined (measured 2026-12-06, 2 layers), 51 with
# the ops, 43 once the projections' group-to-site maps were the ops' int lists, not tensors the
# graph built each call: 38 of them the ops (forward: 3 a projection, weight sums included, and
# 3 the route's; backward: 5 a linear layer's and 3 the route's), 5 zeroed records tensors
# (issue 55's sampled rows, opt-in, add one: sdpa_fwd_sample).
REGISTERED_OPS_EXTRA_CEILING = 43


def test_a_compiled_model_runs_the_registered_check_ops():
    from attnchecker import ABFTConfig, kernels

    if not kernels.available():
        pytest.skip("needs triton (or its interpreter)")
    base = build("llama", layers=1)
    base.train()
    base.set_attn_implementation("sdpa")
    inputs = batch("llama")
    counts = {}
    for arm in ("plain", "protected"):
        torch._dynamo.reset()
        counters.clear()
        model = copy.deepcopy(base)
        handle = (
            protect_(model, ABFTConfig(backend="sdpa", check_impl="triton"))
            if arm != "plain"
            else None
        )
        compiled = torch.compile(model, fullgraph=True)
        with inductor_kernels() as calls:
            compiled(**inputs).loss.backward()
        counts[arm] = calls
    print(f"llama, compiled: {dict(counts['plain'])} plain, {dict(counts['protected'])} protected")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counts["protected"]["fallback"] - counts["plain"]["fallback"] >= 38  # the ops, called
    assert counts["protected"].total - counts["plain"].total <= REGISTERED_OPS_EXTRA_CEILING
    assert handle.drain() == []
    model.zero_grad(set_to_none=True)
    # a fault in the compiled program: corrected by the ops' repair, as in eager
    snapshot = copy.deepcopy(model.state_dict())
    want = _compiled_step(model, compiled, inputs)
    model.load_state_dict(snapshot)
    hook = fire_once("v", "1R", "inf", layer=0)
    detach = handle.attach(hook)
    got = _compiled_step(model, compiled, inputs)
    detach.remove()
    assert hook.fired
    assert torch.allclose(got[0], want[0], rtol=1e-6)
    assert max_diff(got[1], want[1]) <= 1e-5
    assert [(e.op, e.action) for e in handle.drain() if e.op == "v"] == [("v", "corrected")]


@pytest.mark.parametrize("family", [pytest.param("llama", marks=SLOW),
                                    pytest.param("gpt2", marks=SLOW)])  # fmt: skip
def test_compiled_registered_ops_correct_every_projection_fault(family):
    """The CUDA default compiled (the route, the checks as registered Triton ops: the
    interpreter here): a fault at each projection (every kind and pattern once across them) is
    corrected in the compiled program as in eager (a recompilation a site: the slow set; the
    default run compiles one, above). The core's sites are emulated in eager only."""
    from attnchecker import ABFTConfig, kernels

    if not kernels.available():
        pytest.skip("needs triton (or its interpreter)")
    torch._dynamo.reset()
    model = build(family, layers=1)
    model.train()
    model.set_attn_implementation("sdpa")
    handle = protect_(model, ABFTConfig(backend="sdpa", check_impl="triton"))
    compiled = torch.compile(model, fullgraph=True)
    _every_fault_corrected(model, compiled, handle, batch(family), ("q", "k", "v", "out"))


@pytest.mark.slow  # 31 s
def test_a_compiled_model_runs_the_accumulator_gemms():
    """``check_impl="accumulator"`` inside a model the user compiles: the accumulator GEMMs stay
    registered ops (one graph, no break), a clean step flags nothing, and a clean compiled
    step's loss equals the eager protected one's."""
    from attnchecker import ABFTConfig, kernels
    from attnchecker.kernels.launches import recorded

    if not (kernels.available() and kernels.interpreting()):
        pytest.skip("needs Triton's interpreter")
    torch._dynamo.reset()
    counters.clear()
    model = build("llama", layers=1)
    model.train()
    model.set_attn_implementation("sdpa")
    inputs = batch("llama")
    handle = protect_(model, ABFTConfig(backend="sdpa", scope="all_linear",
                                        check_impl="accumulator"))  # fmt: skip
    snapshot = copy.deepcopy(model.state_dict())
    want = _compiled_step(model, model, inputs)  # eager, protected
    model.load_state_dict(snapshot)
    compiled = torch.compile(model, fullgraph=True)
    with recorded() as launches:
        got = _compiled_step(model, compiled, inputs)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # the MLP's three, the LM head and the projections (q, k, v, o): y, dX and dW each
    assert sum(la.kernel == "mm_kernel" for la in launches) == 8 * 3
    assert handle.drain() == []
    assert torch.allclose(got[0], want[0], rtol=1e-5)
    assert max_diff(got[1], want[1]) <= 1e-4
