"""The diagnosis tells a computation fault (your hardware) from numerics (not your hardware,
when every GEMM upstream is checked; unknown, when one is not), from real protected steps: an
injected fault, an fp16 overflow in the forward or the backward, a NaN or a spiking loss with no
GEMM at fault; and names the rank whose faults stand out."""

from __future__ import annotations

import warnings

import torch

from attnchecker import ABFTConfig, protect_
from attnchecker.recovery.diagnosis import Here, RankCounts, classify, outliers, tally

from .helpers import batch, fire_once, models

HERE = Here(3, "h2", "cuda:1")


def _step(model, handle, *, fp16=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(**batch("llama")).loss
        loss.backward()
        return float(loss.detach()), handle.drain()


def test_a_corrected_fault_is_the_hardware():
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn"))
    handle.attach(fire_once("dv", "1R", "inf", layer=1), sites=["dv"])
    loss, events = _step(model, handle)
    f = classify(events, step=7, loss=loss, where=HERE)
    assert (f.cause, f.verdict, f.trainable) == ("fault", "your hardware", True)
    assert f.message.startswith("your hardware: 1 corrected computation fault(s) on rank 3, ")
    assert "layer 1 dv" in f.message and f.ops == ("layer 1 dv",)


def _overflow(layer: int, scope: str = "attention"):
    """Q and K weights of ``layer`` 3000x too large (a run diverging): q . k overflows fp16
    there; the checks flag it and recomputing gives the same: the operands imply it."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn", scope=scope))
    attn = model.model.layers[layer].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(3e3)
        attn.k_proj.weight.mul_(3e3)
    loss, events = _step(model, handle, fp16=True)
    assert events and {e.cause for e in events} == {"numerics"}
    return classify(events, step=1, loss=loss, where=HERE, config=handle.config)


def test_an_fp16_overflow_in_layer_0_is_numerics_and_names_the_op():
    """Upstream of layer 0's scores run only its Q, K and V projections, all checked and
    consistent: the overflow is the operands' own (numerics), not the hardware."""
    f = _overflow(0)
    assert (f.cause, f.verdict, f.trainable) == ("numerics", "not your hardware", False)
    assert f.ops[0] == "layer 0 scores"
    assert "recomputing layer 0 scores from its operands" in f.message
    assert "every GEMM upstream is checked" in f.message


def test_an_overflow_after_an_unchecked_mlp_is_not_blamed_on_numerics():
    """In layer 1 the MLP of layer 0 ran upstream, unchecked with scope="attention": its
    inputs were bad, but a fault there would look the same. Checking every linear layer
    (scope="all_linear") leaves no unchecked GEMM upstream."""
    f = _overflow(1)
    assert (f.cause, f.verdict, f.trainable) == ("numerics", "unknown", False)
    assert f.message.startswith("unknown: numerics, or a fault upstream in a GEMM no check sees")
    assert "the MLP of layer 0" in f.message and "not your hardware" not in f.message
    assert "Recomputing layer 1 scores from its operands" in f.message
    f = _overflow(1, scope="all_linear")
    assert (f.verdict, f.ops[0]) == ("not your hardware", "layer 1 scores")
    assert "every GEMM upstream is checked" in f.message


def _backward_overflow(scope: str):
    """A loss scale far too large (1e6, fp16): the gradients overflow in the backward, the
    forward is finite."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn", scope=scope))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch("llama")).loss
        (loss * 1e6).backward()
        events = handle.drain()
    assert events and {e.cause for e in events} == {"numerics"}
    return classify(events, step=1, loss=float(loss.detach()), where=HERE, config=handle.config)


def test_a_backward_overflow_has_the_unchecked_head_and_mlps_upstream():
    """Every backward op has the whole forward, the loss and the LM head upstream: with
    scope="attention" the head and the MLPs are unchecked, so the verdict is unknown; the first
    op in execution order is the last layer's output projection (dX of o_proj)."""
    f = _backward_overflow("attention")
    assert (f.cause, f.verdict, f.trainable) == ("numerics", "unknown", False)
    assert f.ops[0] == "layer 1 dx.out"
    assert "Recomputing layer 1 dx.out from its operands" in f.message
    assert "every layer's MLP and the head" in f.message
    # all_linear: the head runs first in the backward and its dW (a sum over every token)
    # overflows; only the forward runs upstream of it, and every GEMM there is checked
    f = _backward_overflow("all_linear")
    assert (f.verdict, f.ops[0]) == ("not your hardware", "lm_head dw")
    assert "every GEMM upstream is checked" in f.message


def test_nan_or_spiking_loss_with_consistent_checks_is_numerics():
    f = classify([], step=5, loss=float("nan"), where=HERE)
    assert (f.cause, f.trainable) == ("numerics", False)
    assert "every check consistent" in f.message
    # the loss has the whole forward upstream: without the config's coverage, or with the MLPs
    # and the head unchecked (scope="attention"), a fault there cannot be ruled out
    assert f.verdict == "unknown" and f.message.startswith("unknown: numerics, or a fault")
    f = classify([], step=5, loss=float("nan"), where=HERE, config=ABFTConfig())
    assert f.verdict == "unknown" and "every layer's MLP and the head" in f.message
    f = classify([], step=5, loss=float("nan"), where=HERE, config=ABFTConfig(scope="all_linear"))
    assert f.verdict == "not your hardware" and "every GEMM upstream is checked" in f.message
    spike = classify([], step=5, loss=90.0, history=[3.0, 3.1, 2.9, 3.0], where=HERE)
    assert spike.cause == "numerics" and "spiked" in spike.message
    assert classify([], step=5, loss=3.2, history=[3.0, 3.1, 2.9], where=HERE) is None


def test_the_rank_whose_faults_stand_out_is_named():
    model, _ = models("llama")
    handle = protect_(model)
    handle.attach(fire_once("scores", "0D", "nan"), sites=["scores"])
    _, events = _step(model, handle)
    bad = RankCounts(3, "h2", "cuda:1")
    tally(bad, events, classify(events, step=1, where=HERE))
    for _ in range(999):
        tally(bad, [], None)
    bad.faults, bad.by_op = 12, {"scores": 12}  # as after eleven more such steps
    ranks = [RankCounts(r, f"h{r // 2}", f"cuda:{r % 2}", steps=1000) for r in range(3)] + [bad]
    assert outliers(ranks) == ["rank 3, host h2, device cuda:1: 12 corrected fault(s) in 1,000 "
                               "steps; others 0"]  # fmt: skip
    assert outliers(ranks[:3]) == []
    summary = handle.summary()
    assert summary["detections"] == {"fault": 1, "numerics": 0}
    assert {"rank", "host", "device"} <= set(summary)
