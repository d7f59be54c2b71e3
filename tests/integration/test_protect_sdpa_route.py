"""``ABFTConfig(backend="sdpa")``: the SDPA route inside real models on a CPU (its flash kernel,
as on CUDA the flash / memory-efficient kernels): training steps equal to the plain model's own
SDPA attention, faults at the core's sites (emulated: the kernel's outputs replaced by what the
corrupted S, P, O, dP, dV, dQ, dK give) corrected in the same step or reported, the launches it
adds counted, and no L x L tensor made.

Tolerances (fp32): against the plain SDPA model the kernel is the same, so loss and gradients
agree to the last bits (1e-6 relative, 1e-5 absolute); a repaired head is recomputed by the same
kernel on fewer heads (fault matrices: the helpers' 1e-6 / 1e-5).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker import ABFTConfig, kernels, protect_
from attnchecker.attention.ops import CORE_OPS, GRAD_OPS, OPS
from attnchecker.gpu_cost import OpTrace
from attnchecker.models.families import FAMILIES as FAMILIES_ALL
from attnchecker.testing import VIEW_OPS, OpCounter

from .helpers import KINDS, batch, fault_matrix, fire_once, max_diff, models, train_step

SDPA = ABFTConfig(backend="sdpa")
# families whose attention runs through transformers' interface, dropout off
FAMILIES = ("llama", "mistral", "qwen3", "phi3", "gpt2", "gpt_neox", "opt", "bert", "bart")
# what the route's checks report a fault at a site as (P is not materialised: a fault in it
# reaches O; one in dP reaches dS, behind dQ and dK)
REPORTED = {"probs": ("context",), "dp": ("dq", "dk")}


def _sdpa_model(base):
    model = copy.deepcopy(base)
    model.set_attn_implementation("sdpa")
    return model


def _plain_step(base, inputs):
    return train_step(_sdpa_model(base), inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_equals_the_plain_models_sdpa_attention(family):
    base, _ = models(family, dropout=False, layers=1)
    inputs = batch(family)  # with padding in the second sample
    want = _plain_step(base, inputs)
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA)
    got = train_step(model, inputs)
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=0), (got[0], want[0])
    assert max_diff(got[1], want[1]) <= 1e-5
    assert handle.drain() == []
    cov = handle.summary()["per_module"]
    assert {c["engine"] for c in cov.values()} == {"sdpa"}
    assert not any(c["fallbacks"] for c in cov.values())


# forward: every kind and pattern at S, P and O, except what lowers scores without making a
# whole row non-finite: -inf, or an exponent flip of a negative score, in single scores (the
# key's weight drops to 0, a finite change of O that no bound sees; the backward's dV sum may
# see it, too late to correct: test below)
PARTIAL = ("0D", "1C", "2D")
UNSEEN = {("scores", "-inf", p) for p in PARTIAL}
LOWERING = UNSEEN | {("scores", "exp_flip", p) for p in PARTIAL}


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_every_extreme_forward_fault_is_corrected(family):
    base, _ = models(family, dropout=False, layers=1)
    failures = fault_matrix(base, batch(family), train_step, config=SDPA.replace(ops=OPS),
                            sites=("scores", "probs", "context"), reported=REPORTED)  # fmt: skip
    # (the sampled rows see a lowered score in a sampled row: some of UNSEEN are corrected)
    assert {f[:3] for f in failures} <= LOWERING, failures


ROUTED = tuple(f for f in FAMILIES_ALL if f not in ("gpt_neo", "gemma2"))
"""Every family whose attention the route takes (GPT-Neo's eager-only options and Gemma 2's
soft-capping run the eager engine)."""


@pytest.mark.parametrize("family", ROUTED)
def test_every_family_corrects_the_core_faults_on_the_route(family):
    """Every family, every core site (forward and backward) and pattern once, the kinds taking
    turns from the family's index (the families together run every site x kind x pattern):
    corrected in the same step, but for the lowered scores the forward cannot see."""
    base, _ = models(family, dropout=False, layers=1)
    rotate = ROUTED.index(family)
    sites = ("scores", "probs", "context", "dq", "dk", "dp", "dv")
    # (policy warn: a lowered score is reported lost by the backward, not raised here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        failures = fault_matrix(base, batch(family), train_step, config=SDPA.replace(
            policy="warn"), sites=sites, reported=REPORTED, rotate=rotate)  # fmt: skip
    assert {f[:3] for f in failures} <= LOWERING, failures


DROPPING = ("gpt2", "bert", "roberta", "distilbert")
"""The families that train with attention dropout by default (0.1): on the route (issue 54)."""


@pytest.mark.parametrize("family", DROPPING)
def test_a_step_with_attention_dropout_equals_the_plain_models(family):
    """Attention dropout on: the route runs the backend's own kernel with its draw (a CPU's
    math backend, as the plain SDPA model does), so the loss is the plain model's to the bit
    and the gradients (its backward in fp32 from the same draw) to 1e-5; no call falls back."""
    base, _ = models(family, layers=1)
    inputs = batch(family)
    want = _plain_step(base, inputs)
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA)
    got = train_step(model, inputs)
    dropped = copy.deepcopy(base)  # (the draw matters: without it the loss differs)
    dropped.set_attn_implementation("sdpa")
    dropped.eval()
    assert not torch.allclose(train_step(dropped, inputs)[0], want[0])
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert max_diff(got[1], want[1]) <= 1e-5
    assert handle.drain() == []
    cov = handle.summary()["per_module"]
    assert {c["engine"] for c in cov.values()} == {"sdpa"}
    assert not any(c["fallbacks"] for c in cov.values())


@pytest.mark.parametrize("family", DROPPING)
def test_every_core_fault_is_corrected_with_attention_dropout_on(family):
    """Attention dropout on, every core site (forward and backward) and pattern once, the kinds
    taking turns: corrected in the same step, equal to the fault-free step with the same draw
    (a repair reruns the whole call from the generator's state before it), but for the lowered
    scores the forward cannot see."""
    base, _ = models(family, layers=1)
    sites = ("scores", "probs", "context", "dq", "dk", "dp", "dv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        failures = fault_matrix(base, batch(family), train_step, config=SDPA.replace(
            policy="warn"), sites=sites, reported=REPORTED,
            rotate=DROPPING.index(family))  # fmt: skip
    assert {f[:3] for f in failures} <= LOWERING, failures


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or the interpreter)")
def test_the_triton_ops_take_a_dropout_call():
    """``check_impl="triton"`` (CUDA's default) with attention dropout on: the Triton family's
    ops run (their verify kernels take the dropout; a repair reads its flag on the host, one
    read a repair op, and on a flag the reference checks again and reruns the call's draw): a
    clean step equals the plain model's, and a forward and a backward fault are corrected."""
    base, _ = models("gpt2", layers=1)
    config = SDPA.replace(check_impl="triton")
    inputs = batch("gpt2")
    want = _plain_step(base, inputs)
    model = copy.deepcopy(base)
    handle = protect_(model, config)
    with OpTrace() as c:  # (it looks into the registered ops)
        got = train_step(model, inputs)
    assert c.ops["attnchecker.sdpa_fwd_repair_triton"] == 1, c.ops
    assert c.ops["attnchecker.sdpa_fwd_repair"] == 0
    with OpTrace() as plain:
        train_step(_sdpa_model(base), inputs)
    reads = Counter(c.syncs)
    reads.subtract(plain.syncs)
    reads.pop("aten.lift_fresh", None)  # (constants made once a process from host data)
    assert +reads == {"aten.is_nonzero": 2}, reads  # the two repairs' reads, nothing else
    assert torch.equal(got[0], want[0]) and max_diff(got[1], want[1]) <= 1e-5
    assert handle.drain() == []
    failures = []
    for site, kind, pattern in (
        ("context", "nan", "1R"),
        ("scores", "inf", "0D"),
        ("dk", "inf", "0D"),
        ("dv", "1e10", "1C"),
        ("dq", "nan", "1R"),
    ):
        failures += fault_matrix(base, inputs, train_step, config=config, sites=(site,),
                                 kinds={kind: KINDS[kind]}, patterns=(pattern,),
                                 reported=REPORTED)  # fmt: skip
    assert not failures, failures


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_backward_fault_is_corrected(family):
    base, _ = models(family, dropout=False, layers=1)
    config = SDPA.replace(ops=tuple(o for o in GRAD_OPS if o in CORE_OPS))
    failures = fault_matrix(base, batch(family), train_step, config=config,
                            sites=("dq", "dk", "dp", "dv"), reported=REPORTED)  # fmt: skip
    assert not failures, failures


def test_a_lowered_score_is_seen_by_the_backward_and_reported_lost():
    """A whole key column of -inf scores (one head): the forward's bounds cannot see it (O
    stays a convex combination); the backward recomputes P from the clean scores with the
    forward's LSE, its rows no longer sum to 1, and the dV and dK sums see that. The forward
    output was already used, so the repair reproduces it: lost, not corrected (the policy then
    decides: skip the step)."""
    base, _ = models("llama", dropout=False, layers=1)
    model = copy.deepcopy(base)
    # (sampled_rows=0, the default: with the sampled rows on, the forward corrects it: below)
    handle = protect_(model, SDPA.replace(policy="warn", sampled_rows=0))
    hook = fire_once("scores", "1C", "-inf")
    handle.attach(hook)
    train_step(model, batch("llama"))
    assert hook.fired
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        events = handle.drain()
    # the dK sum sees it too (the rows of dS no longer sum to 0); recomputing from the saved
    # LSE reproduces it, so the cause reads "numerics": the saved state is what is wrong
    assert {(e.op, e.action) for e in events} == {("dk", "uncorrectable"), ("dv", "uncorrectable")}
    assert {e.cause for e in events} == {"numerics"}


def test_a_lowered_score_is_corrected_in_the_forward_by_the_sampled_rows():
    """The same lowered key column with the sampled rows on: a sampled row's LSE and O differ
    from their fp32 recomputation, the head is recomputed: corrected."""
    base, _ = models("llama", dropout=False, layers=1)
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA.replace(policy="warn", sampled_rows=2))
    hook = fire_once("scores", "1C", "-inf")
    handle.attach(hook)
    train_step(model, batch("llama"))
    assert hook.fired
    events = {(e.op, e.action) for e in handle.drain()}  # (O moved too: the context check's)
    assert ("scores", "corrected") in events and all(a != "uncorrectable" for _, a in events)
    assert handle.summary()["per_module"]["model.layers.0.self_attn"]["sampled"]["rows"] == 2


class _Squares(TorchDispatchMode):
    """Counts the tensors made whose last two dimensions are (L, L)."""

    def __init__(self, L: int) -> None:
        super().__init__()
        self.L, self.made = L, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            square = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2:] == (self.L,) * 2
            if square and name not in VIEW_OPS:
                self.made[name] += 1
        return out


LAYERS, TARGET = 2, 15


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_core_checks_add_at_most_15_launches_per_layer_and_no_square(family):
    """Issue 43's counts: the core's checks alone (forward and backward) add at most 15
    launching ops per layer over the plain SDPA model, no host synchronisation on a CPU's
    clean step, and no tensor of size L x L (the plain model makes none either: no padding)."""
    base, _ = models(family, dropout=False, layers=LAYERS, max_len=64)
    base.set_attn_implementation("sdpa")
    L = 24
    ids = torch.randint(3, 128, (2, L), generator=torch.Generator().manual_seed(0))

    def step(model):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def counted(model):
        step(model)  # warm-up
        with OpCounter() as c, _Squares(L) as sq:
            step(model)
        return c, sq.made

    plain, plain_sq = counted(copy.deepcopy(base))
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA.replace(ops=CORE_OPS))
    got, got_sq = counted(model)
    extra = Counter({k: got.ops[k] - plain.ops.get(k, 0) for k in got.ops if k not in VIEW_OPS})
    assert (got.launching - plain.launching) / LAYERS <= TARGET, extra
    assert got_sq == plain_sq == Counter(), (got_sq, plain_sq)
    assert got.syncs == plain.syncs, (got.syncs, plain.syncs)
    for op in ("sdpa_kv_stats", "sdpa_fwd_verify", "sdpa_fwd_repair", "sdpa_bwd_verify",
               "sdpa_bwd_sums", "sdpa_bwd_repair"):  # fmt: skip
        assert extra[f"attnchecker.{op}"] == LAYERS, extra
    assert handle.drain() == []


@pytest.mark.parametrize("layout", ["nanogpt", "x_transformers", "torchtitan"])
def test_a_model_of_ones_own_calling_sdpa_runs_the_route(layout):
    """Models that call F.scaled_dot_product_attention (causal, a bool padding mask, GQA):
    their calls run the route, equal to the plain calls, and a fault in a context is
    corrected."""
    from . import sdpa_models

    base = sdpa_models.build(layout)
    ids = torch.randint(0, sdpa_models.VOCAB, (2, sdpa_models.T),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    want = base(ids)
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA, example=(ids,))
    assert {c["engine"] for c in handle.summary()["per_module"].values()} == {"sdpa"}
    assert torch.allclose(model(ids), want, rtol=1e-5, atol=1e-6)
    hook = fire_once("context", "1R", "nan", layer=None)
    handle.attach(hook)
    got = model(ids)
    got.float().square().mean().backward()
    assert hook.fired and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert [(e.op, e.action) for e in handle.drain()] == [("context", "corrected")]


def test_compiled_the_route_is_one_graph_that_never_recompiles():
    """fullgraph=True: the autograd function, the aten kernel and the check ops trace into one
    graph (the ops are opaque), three clean steps compile once, and the step equals the plain
    model's compiled SDPA step. (The core's sites are not reached under compile: faults are
    emulated in eager, as campaigns run.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    base, _ = models("llama", dropout=False, layers=2)
    inputs = batch("llama")
    plain = copy.deepcopy(base)
    plain.set_attn_implementation("sdpa")
    want = train_step(torch.compile(plain), inputs)
    torch._dynamo.reset()
    counters.clear()
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA)
    compiled = torch.compile(model, fullgraph=True)
    frames, results = [], []
    for _ in range(3):
        results.append(train_step(compiled, inputs))
        assert handle.drain() == []
        frames.append(counters["frames"]["total"])
    got = results[0]  # (each step updates the weights)
    assert frames == frames[:1] * 3, f"recompiled: {frames}"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.allclose(got[0], want[0], rtol=1e-6)
    assert max_diff(got[1], want[1]) <= 1e-5


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or the interpreter)")
def test_the_triton_kernels_run_the_route_in_a_model():
    """``check_impl="triton"`` (what ``"auto"`` runs on CUDA): the check ops run their Triton
    kernels (the interpreter here): a clean step equals the plain model's, and faults in the
    forward and the backward are corrected by the kernels' repairs, as by the reference's."""
    base, _ = models("llama", dropout=False, layers=1)
    config = SDPA.replace(check_impl="triton")
    inputs = batch("llama")
    want = _plain_step(base, inputs)
    model = copy.deepcopy(base)
    handle = protect_(model, config)
    with OpCounter() as c:
        got = train_step(model, inputs)
    assert c.ops["attnchecker.sdpa_fwd_repair_triton"] == 1  # the kernels' family of ops
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
    assert max_diff(got[1], want[1]) <= 1e-5
    assert handle.drain() == []
    cases = [(s, "inf", "1R") for s in ("scores", "probs")] + [
        ("context", "nan", "0D"), ("dq", "nan", "1R"), ("dk", "1e10", "0D"),
        ("dv", "inf", "1C"), ("dp", "nan", "0D")]  # fmt: skip
    failures = []
    for site, kind, pattern in cases:
        failures += fault_matrix(base, inputs, train_step, config=config, sites=(site,),
                                 kinds={kind: KINDS[kind]}, patterns=(pattern,),
                                 reported=REPORTED)  # fmt: skip
    assert not failures, failures


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or the interpreter)")
@pytest.mark.parametrize(("family", "target"), [("llama", 45), ("gpt2", 30)])
def test_the_cuda_default_adds_at_most_a_few_dozen_launches_per_layer(family, target):
    """The default config as CUDA runs it (the SDPA route, every check a registered Triton op:
    ``check_impl="triton"``, the interpreter here), counted on a CPU: at most 45 (llama) / 30
    (gpt2) launching ops per layer over the plain SDPA model, forward and backward (the eager
    engine's default adds ~1,100 / ~800), and no host synchronisation."""
    base, _ = models(family, dropout=False, layers=LAYERS, max_len=64)
    base.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))

    def counted(model):
        for counting in (False, True):  # a warm-up step first
            model.zero_grad(set_to_none=True)
            with OpCounter() if counting else contextlib.nullcontext() as c:
                model(input_ids=ids, labels=ids).loss.backward()
        return c

    plain = counted(copy.deepcopy(base))
    model = copy.deepcopy(base)
    handle = protect_(model, SDPA.replace(check_impl="triton"))
    got = counted(model)
    assert (got.launching - plain.launching) / LAYERS <= target
    assert got.syncs == plain.syncs
    assert handle.drain() == []


def test_the_self_test_passes_here_and_names_what_breaks(monkeypatch):
    """``backend="auto"`` takes the route on CUDA only where its self-test passes: here it does
    (under no_grad too, as protect_ may be called), and a kernel that fails gives the reason."""
    from attnchecker.attention import sdpa_core

    monkeypatch.setattr(sdpa_core, "_SELF_TESTS", {})
    with torch.no_grad():
        assert sdpa_core.self_test("cpu") is None
    assert torch.is_grad_enabled()
    sdpa_core._SELF_TESTS.clear()

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(sdpa_core, "attention_forward", broken)
    assert sdpa_core.self_test("cpu") == "RuntimeError: no kernel image is available"
