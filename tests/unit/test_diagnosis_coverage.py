"""The diagnosis claims "not your hardware" only when every GEMM upstream of the first op whose
recomputation reproduced the flagged result (or of the loss) is checked at that step: ops left
out by ``ops``, ``layers`` or a schedule, and the linear layers outside attention with
``scope="attention"``, make the verdict "unknown" and are named. Upstream is execution order:
the forward by layer (the head last), then the backward from the head down; weight gradients
feed nothing."""

from __future__ import annotations

from attnchecker import ABFTConfig
from attnchecker.models.handle import Event
from attnchecker.recovery.diagnosis import UNKNOWN, VERDICT, Here, classify

HERE = Here(0, "h0", "cpu")
SURE = VERDICT["numerics"]  # "not your hardware"


def _event(layer: int, op: str, *, step: int = 1, cause: str = "numerics", module: str = ""):
    module = module or f"model.layers.{layer}.self_attn"
    return Event(step, module, layer, op, "2D", "inf", "recomputed", 4, 4, cause=cause)


def _verdict(events, config, step: int = 1):
    return classify(events, step=step, where=HERE, config=config)


def test_without_the_coverage_the_verdict_is_unknown():
    f = classify([_event(0, "q")], step=1, where=HERE)
    assert (f.cause, f.verdict) == ("numerics", UNKNOWN)
    assert "coverage was not given" in f.message
    assert _verdict([_event(0, "q")], ABFTConfig()).verdict == SURE
    f = classify([_event(1, "dq", cause="fault"), _event(0, "q")], step=1, where=HERE)
    assert (f.cause, f.verdict) == ("fault", "your hardware")  # coverage or not


def test_a_schedule_that_leaves_an_upstream_op_off_that_step():
    # Q every other step (steps 1, 3, ...), K, V and the scores every step
    cfg = ABFTConfig(schedule=((0, "q", 2), (0, "k", 1), (0, "v", 1), (0, "scores", 1)))
    off = _verdict([_event(0, "scores", step=2)], cfg)
    assert off.verdict == UNKNOWN
    assert "layer 0's q (left off by the schedule at step 2)" in off.message
    assert _verdict([_event(0, "scores", step=3)], cfg).verdict == SURE


def test_ops_and_layers_left_out_are_named():
    f = _verdict([_event(0, "scores")], ABFTConfig(ops=("q", "v", "scores")))
    assert f.verdict == UNKNOWN and "layer 0's k (not in ops)" in f.message
    f = _verdict([_event(1, "q")], ABFTConfig(layers=(1,)))
    assert "layer 0's attention (not in layers)" in f.message
    assert "the MLP of layer 0" in f.message
    # all_linear checks the projections of a layer left out as plain linear layers
    f = _verdict([_event(1, "q")], ABFTConfig(layers=(1,), scope="all_linear"))
    assert f.verdict == UNKNOWN and "layer 0's scores, probs, context (not in layers)" in f.message
    assert "MLP" not in f.message
    assert _verdict([_event(1, "q")], ABFTConfig(scope="all_linear")).verdict == SURE


def test_the_backward_sees_the_whole_forward_and_the_layers_above():
    all_linear = ABFTConfig(scope="all_linear")
    assert _verdict([_event(0, "dx.q")], all_linear).verdict == SURE
    f = _verdict([_event(0, "dq")], ABFTConfig(scope="all_linear", layers=(0,)))
    assert f.verdict == UNKNOWN and "any layer not in layers=(0,)" in f.message
    # weight gradients feed nothing: dW of the output projection is not upstream of dP
    no_dw = tuple(op for op in all_linear.ops if op != "dw.out")
    assert _verdict([_event(0, "dp")], all_linear.replace(ops=no_dw)).verdict == SURE
    no_dx = tuple(op for op in all_linear.ops if op != "dx.out")
    f = _verdict([_event(0, "dp")], all_linear.replace(ops=no_dx))
    assert f.verdict == UNKNOWN and "dx.out (not in ops)" in f.message


def test_execution_order_names_the_first_op():
    """In a layer's backward the output projection runs first, then dP / dV, then dQ / dK; the
    head (a linear outside the blocks) runs after the last layer, and first in the backward."""
    f = _verdict([_event(1, "dq"), _event(1, "dx.out")], ABFTConfig())
    assert f.ops == ("layer 1 dx.out", "layer 1 dq")
    head = _event(-1, "y", module="lm_head")
    f = _verdict([head, _event(1, "y", module="model.layers.1.mlp.up_proj")], ABFTConfig())
    assert f.ops == ("layer 1 y", "lm_head y")
    head = _event(-1, "dx", module="lm_head")
    assert _verdict([_event(1, "dx"), head], ABFTConfig()).ops == ("lm_head dx", "layer 1 dx")


def test_a_decoder_has_the_whole_encoder_upstream():
    """BART's decoder layers restart at 0: the encoder, MLPs and all, runs before its layer 0
    (whose cross-attention reads the encoder's output)."""
    cross = _event(0, "k", module="model.decoder.layers.0.encoder_attn")
    encoder = _event(1, "scores", module="model.encoder.layers.1.self_attn")
    f = _verdict([cross], ABFTConfig())
    assert f.verdict == UNKNOWN and "every MLP of the encoder" in f.message
    assert _verdict([cross], ABFTConfig(scope="all_linear")).verdict == SURE
    assert _verdict([cross, encoder], ABFTConfig()).ops == (
        "layer 1 scores", "layer 0 k"
    )  # fmt: skip
