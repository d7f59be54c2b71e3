"""The diagnosis tells a computation fault (your hardware) from numerics (not your hardware),
from real protected steps: an injected fault, an fp16 overflow, a NaN or a spiking loss with no
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
    assert (f.cause, f.verdict, f.trainable) == ("computation_fault", "your hardware", True)
    assert f.message.startswith("your hardware: 1 corrected computation fault(s) on rank 3, ")
    assert "layer 1 dv" in f.message and f.ops == ("layer 1 dv",)


def test_an_fp16_overflow_is_numerics_and_names_the_op():
    """Q and K weights 3000x too large (a run diverging): q . k overflows fp16 in layer 1. The
    checks flag it, recomputing gives the same: the operands imply it, not the hardware."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn"))
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(3e3)
        attn.k_proj.weight.mul_(3e3)
    loss, events = _step(model, handle, fp16=True)
    assert events and {e.cause for e in events} == {"numerics"}
    f = classify(events, step=1, loss=loss, where=HERE)
    assert (f.cause, f.verdict, f.trainable) == ("numerics", "not your hardware", False)
    assert "recomputing layer 1 scores from its operands" in f.message


def test_nan_or_spiking_loss_with_consistent_checks_is_numerics():
    f = classify([], step=5, loss=float("nan"), where=HERE)
    assert (f.cause, f.trainable) == ("numerics", False)
    assert "every check consistent" in f.message
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
