"""Issue 42's launch targets, counted on a CPU: with ``check_impl="triton"`` every GEMM check is
a few registered ops (``attnchecker.kernels.gemm_check``, ``.projection_check``, in Triton's
interpreter here; one call is one dispatched op, as on a GPU one launch), so a training step of
a tiny 2-layer model adds, per layer over the plain SDPA model, at most 40 (llama) / 30 (gpt2)
launching ops with the projection checks and 90 / 70 with every linear layer's. Counts, not
times. The weight-side sums are computed once per weight per step and shared by the forward
check and the backward's dX check; after an optimizer step (a fused AdamW, which does not bump
version counters) they are computed afresh: a stale sum would alarm on every row."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from attnchecker import ABFTConfig, kernels, protect_
from attnchecker.attention.ops import OP_TABLE
from attnchecker.models.tiny import build
from attnchecker.testing import VIEW_OPS, OpCounter

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")

PROJECTIONS = tuple(o.name for o in OP_TABLE if o.part == "projection")
TARGET = {("llama", "attention"): 40, ("gpt2", "attention"): 30,
          ("llama", "all_linear"): 90, ("gpt2", "all_linear"): 70}  # fmt: skip
LAYERS = 2


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def _counted(model, ids) -> OpCounter:
    _step(model, ids)  # warm-up: constants built, sinks made
    with OpCounter() as c:
        _step(model, ids)
    return c


def _config(scope):
    return ABFTConfig(ops=PROJECTIONS, scope=scope, check_impl="triton")


@pytest.mark.parametrize("scope", ["attention", "all_linear"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_checked_step_adds_at_most_the_target_launches_per_layer(family, scope):
    base = build(family, layers=LAYERS, max_len=64)
    base.train()
    base.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = _counted(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    handle = protect_(model, _config(scope))
    got = _counted(model, ids)
    extra = Counter({k: got.ops[k] - plain.ops.get(k, 0) for k in got.ops if k not in VIEW_OPS})
    per_layer = (got.launching - plain.launching) / LAYERS
    assert per_layer <= TARGET[family, scope], extra
    # after the warm-up step: no host sync, no tensor built from host data (a CUDA graph
    # captures what this step launches)
    assert got.syncs == plain.syncs and "aten.lift_fresh" not in extra, (got.syncs, extra)
    # what is left of the checks' own aten ops: a handful a step (the records' accumulation)
    assert sum(n for k, n in extra.items() if k.startswith("aten.")) <= 2 * LAYERS, extra
    # per checked GEMM: the forward check two ops, a backward one three at most (dX two: W's
    # references come with the step's weight sums, computed once per weight for both)
    linears = extra["attnchecker.proj_weights"]
    assert extra["attnchecker.proj_verify"] == extra["attnchecker.proj_repair"] == linears
    assert extra["attnchecker.gemm_verify"] == extra["attnchecker.gemm_repair"] == 2 * linears
    assert extra["attnchecker.gemm_refs"] == linears  # dW's (of X), none for dX
    per_layer_linears = {("llama", "attention"): 4, ("gpt2", "attention"): 2,
                         ("llama", "all_linear"): 7, ("gpt2", "all_linear"): 4}  # fmt: skip
    assert linears >= per_layer_linears[family, scope] * LAYERS
    assert handle.drain() == []


def _twins(layers: int, scope: str):
    """(plain llama, a protected copy, its handle, a fused AdamW at lr 3e-2 for each)."""
    base = build("llama", layers=layers, max_len=64)
    base.train()
    base.set_attn_implementation("sdpa")
    plain, model = copy.deepcopy(base), copy.deepcopy(base)
    handle = protect_(model, _config(scope))
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-2, fused=True) for m in (plain, model)]
    return plain, model, handle, opts


@pytest.mark.slow  # 48 s
def test_the_weight_sums_follow_a_fused_optimizer_step_by_step():
    """Five steps of a fused AdamW at a large learning rate (the weights move a lot) with the
    checks on the registered ops: no false alarm, and the losses equal the plain model's (a
    clean check writes nothing; ten steps also passed when this was written, halved for the
    suite's time)."""
    plain, model, handle, opts = _twins(LAYERS, "all_linear")
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(3, 128, (2, 24), generator=g)
        losses = []
        for m, opt in zip((plain, model), opts, strict=True):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(*losses)
    assert handle.drain() == []


@pytest.mark.slow  # 26 s
def test_micro_batches_of_one_optimizer_step_share_the_weight_sums():
    """Gradient accumulation (4 micro-batches a step, a fused AdamW that bumps no version): after
    the first optimizer step (before it, the clock cannot tell an optimizer's updates from a
    hand-written one's) the weight sums are computed once per weight per step, not per
    micro-batch, and afresh after the step (no false alarm; the losses equal the plain
    model's). One layer, the attention's projections: a count, kept short."""
    plain, model, handle, opts = _twins(1, "attention")
    g = torch.Generator().manual_seed(2)
    weights = []
    for _ in range(2):
        batches = [torch.randint(3, 128, (2, 24), generator=g) for _ in range(4)]
        for m, opt in zip((plain, model), opts, strict=True):
            with OpCounter() as c:
                losses = [m(input_ids=ids, labels=ids).loss for ids in batches]
                for loss in losses:
                    (loss / 4).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if m is model:
                weights.append(c.ops["attnchecker.proj_weights"])
                got = torch.stack(losses).detach()
            else:
                want = torch.stack(losses).detach()
        assert torch.equal(got, want)
    assert weights == [4 * 4, 4], weights  # q, k, v, o: four weights a step after the first
    assert handle.drain() == []
