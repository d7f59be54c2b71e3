"""Runtime behaviour: no host sync, gradient checkpointing, bf16 autocast, many clean steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from attnchecker import ABFTConfig, protect_
from attnchecker.attention.config import OPS
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import build

from .helpers import KINDS, added_syncs, batch, bf16_q_row_fault, max_diff, models, train_step


@pytest.mark.parametrize("family", FAMILIES)
def test_protection_adds_no_host_sync(family):
    """A clean protected forward + backward synchronises no more often than the plain model
    (transformers itself may synchronise, e.g. while building masks; protection adds nothing).
    A tensor built from host data counts (on CUDA it waits for the stream): the backward's
    records index was one per check until the GPU's sync detector saw it."""
    protected, plain = models(family)
    protect_(protected)
    inputs = batch(family)
    assert added_syncs(protected, plain, inputs) == {}


@pytest.mark.parametrize("scope", ["attention", "all_linear"])
def test_the_records_stay_in_the_same_memory_across_steps(scope):
    """What a CUDA graph needs of the records (spec gpu-path §6): every record tensor, the
    backward's sinks' gradients included, keeps its storage from step to step (a drain zeroes
    in place; setting .grad to None made autograd allocate anew each step, memory a captured
    step would no longer write), and a drain still reads only its own step: a fault in step 2
    is one event at drain 2 and none at drain 3."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(scope=scope))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = batch("llama")

    def memory() -> list[int]:
        recs = [st.records for st in handle._states.values()]
        return [t.data_ptr() for r in recs for t in (r.log, r.sink.grad) if t is not None]

    def hook(c):
        if c.site == "dx.q" and c.layer == 1:
            c.tensor[(1,) * (c.tensor.dim() - 1) + (5,)] = float("inf")

    seen, events = [], []
    for step in range(4):
        detach = handle.attach(hook) if step == 2 else None
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
        if detach is not None:
            detach.remove()
        seen.append(memory())
        events.append([e.op for e in handle.drain()])
    assert seen[1] == seen[2] == seen[3] and len(seen[1]) > len(handle.modules)
    assert events[2] == ["dx.q"] and events[3] == [] and events[1] == [], events


@pytest.mark.parametrize(
    ("family", "passes", "value"),
    [
        *((f, "first", float("inf")) for f in ("bert", "gpt2", "llama")),
        ("llama", "both", float("inf")),
        ("llama", "both", float("nan")),
    ],
)
def test_gradient_checkpointing_replays_are_checked_not_counted(family, passes, value):
    """A fault in the first pass of a checkpointed layer is one detection, its replay checked
    and not counted again; so is the same fault in both passes (a persistent one, or an
    overflow both passes compute): the replay's records equal the first pass's, NaN included
    (the delivered value is NaN in both), and are dropped."""
    base, ref = models(family)
    base.activation_checkpointing_enable()
    ref.activation_checkpointing_enable()
    inputs = batch(family)
    want = train_step(ref, inputs)
    handle = protect_(base)
    calls = {"forward": 0, "replay": 0}

    def fault(c):
        if c.site == "scores" and c.layer == 0:
            calls["replay" if c.replay else "forward"] += 1
            if passes == "both" or not c.replay:
                c.tensor[0, 1, 2, 3] = value

    handle.attach(fault)
    got = train_step(base, inputs)
    assert calls == {"forward": 1, "replay": 1}
    assert torch.allclose(got[0], want[0], rtol=1e-6)
    assert max_diff(got[1], want[1]) <= 1e-5
    assert handle.counters()["scores"] == {"detected": 1, "corrected": 1, "uncorrectable": 0}
    events = handle.drain()
    assert [(e.op, e.replay, e.count) for e in events] == [("scores", False, 1)]


def _replay_fault(heads: int):
    """NaN in ``heads`` heads of layer 0's scores, in the checkpointing replay only."""

    def fault(c):
        if c.site == "scores" and c.layer == 0 and c.replay:
            c.tensor[0, :heads] = float("nan")

    return fault


@pytest.mark.parametrize("config", ["forward", "default"])
def test_a_fault_in_a_replay_alone_is_counted(config):
    """A fault that hits only the checkpointing replay is not a duplicate of the first pass: it
    is checked and counted; beyond the repair budget it is uncorrectable and sets found_inf
    (a guarded optimizer skips the step), with cause "fault" (issue 21: it was dropped, the
    gradients were NaN and found_inf 0)."""
    base, _ = models("llama")
    base.gradient_checkpointing_enable()
    kw = {"ops": OPS} if config == "forward" else {}
    handle = protect_(base, ABFTConfig(max_heads=1, policy="warn", **kw))
    handle.attach(_replay_fault(heads=2))
    base(**batch("llama")).loss.backward()
    assert float(handle.found_inf()) == 1.0
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        events = handle.drain()
    first = [e for e in events if e.op == "scores"]
    assert [(e.layer, e.action, e.cause) for e in first] == [(0, "uncorrectable", "fault")]


def test_a_corrected_fault_in_a_replay_alone_gives_the_clean_gradients():
    base, ref = models("llama")
    base.gradient_checkpointing_enable()
    ref.gradient_checkpointing_enable()
    inputs = batch("llama")
    want = train_step(ref, inputs)
    handle = protect_(base)
    handle.attach(_replay_fault(heads=1))
    got = train_step(base, inputs)
    assert torch.allclose(got[0], want[0], rtol=1e-6)
    assert max_diff(got[1], want[1]) <= 1e-5
    events = handle.drain()
    assert [(e.op, e.action) for e in events] == [("scores", "recomputed")]  # a whole head


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_clean_and_faulty(family):
    protected, plain = models(family)
    inputs = batch(family)
    handle = protect_(protected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = train_step(protected, inputs)
        want = train_step(plain, inputs)
    assert torch.equal(got[0], want[0])
    assert max_diff(got[1], want[1]) == 0.0
    assert handle.drain() == []

    # and a fault under autocast is corrected to bf16 precision
    got, want, events = bf16_q_row_fault(copy.deepcopy(plain), copy.deepcopy(plain), inputs, "cpu")
    assert torch.allclose(got[0], want[0], rtol=1e-2)
    assert max_diff(got[1], want[1]) <= 1e-2
    assert [e.action for e in events] == ["corrected"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_no_false_alarm_over_many_training_steps(family, autocast):
    model = build(family)
    model.train()
    handle = protect_(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(25):
        inputs = batch(family, seed=step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert handle.drain() == []
    assert handle.step == 25


def test_sites_fire_on_an_instrumented_unprotected_model():
    from attnchecker import ABFTConfig

    model = build("llama")
    handle = protect_(model, ABFTConfig(ops=()))
    seen = []
    handle.attach(lambda c: seen.append((c.layer, c.site, tuple(c.tensor.shape))))
    model(**batch("llama"))
    sites = [s for _, s, _ in seen]
    assert sites == ["q", "k", "v", "scores", "probs", "context", "out"] * 2
    assert dict(((layer, s), shape) for layer, s, shape in seen)[(0, "k")] == (2, 16, 16)  # GQA


def test_kind_table_is_complete():
    assert set(KINDS) == {"inf", "-inf", "nan", "1e10", "exp_flip", "random_large"}


@pytest.mark.parametrize(
    "config",
    [ABFTConfig(policy="warn"),
     pytest.param(ABFTConfig(backend="sdpa", check_impl="triton", policy="warn"),
                  marks=pytest.mark.slow),  # 24 s
     ABFTConfig(backend="triton", policy="warn")],
    ids=["eager_core", "sdpa_route_triton", "fused_kernels"],
)  # fmt: skip
def test_the_replay_rule_is_the_same_for_every_implementation(config):
    """One rule for every writer of the forward's records (``Records.commit``): a checkpointing
    replay's records count where they differ from the first pass's. The registered ops (the
    SDPA route's and the GEMM checks' Triton kernels) and the fused kernels' counters (the
    interpreter here), which write themselves, learn at a module's first replay to keep their
    first pass; from the next step on a fault in a replay alone is counted, one in both passes
    once (the first replayed step, with no first pass kept, counts only its first pass's)."""
    from attnchecker import kernels
    from attnchecker.attention.sites import in_replay
    from attnchecker.kernels.flash import KernelFault

    if (config.check_impl == "triton" or config.backend == "triton") and not kernels.available():
        pytest.skip("needs triton (CUDA or the interpreter)")
    base, _ = models("llama", dropout=False, layers=1)
    base.gradient_checkpointing_enable()
    handle = protect_(base, config)
    inputs = batch("llama")
    hit = {"passes": ()}

    def fault(c):  # a fault at the context site (the eager core's, the route's emulated one)
        at = "replay" if c.replay else "first"
        if c.site == "context" and c.layer == 0 and at in hit["passes"]:
            c.tensor[0, 1, 2, 3] = float("nan")

    def kernel_fault(query, key):  # the fused kernels': in their P V accumulator
        at = "replay" if in_replay() else "first"
        return KernelFault("pv", 0, 1, 2, 3, math.nan) if at in hit["passes"] else None

    op = "pv" if config.backend == "triton" else "context"
    if op == "pv":
        handle.state(handle.modules[0]).kernel_fault = kernel_fault
    else:
        handle.attach(fault)
    counts = []
    for passes in [(), ("replay",), ("first", "replay"), ("replay",)]:
        hit["passes"] = passes
        base.zero_grad(set_to_none=True)
        base(**inputs).loss.backward()
        counts.append(sum(e.count for e in handle.drain() if e.op == op))
    # a clean step (its replay is the first), then a fault in the replay alone counted, one in
    # both passes once, one in the replay alone again
    assert counts == [0, 1, 1, 1], counts
