"""sdc.fingerprint: the statistics and the bit hash of one tensor, the comparison of two
recordings from files alone (hand-written), and the Recorder on a plain two-block model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnchecker.sdc.fingerprint import Recorder, compare, fingerprint

# ------------------------------------------------------------------------------ fingerprint


def test_statistics_are_over_the_finite_elements_in_float64():
    t = torch.tensor([1.0, -2.0, float("nan"), 3.0, float("inf"), -float("inf")])
    fp = fingerprint(t)
    assert fp["sum"] == 2.0 and fp["norm"] == pytest.approx(math.sqrt(14.0))
    assert fp["absmax"] == 3.0 and fp["nonfinite"] == 3
    assert isinstance(fp["hash"], int) and 0 <= fp["hash"] < (1 << 61) - 1
    none = fingerprint(torch.full((4,), float("nan")))
    assert (none["sum"], none["norm"], none["absmax"], none["nonfinite"]) == (0.0, 0.0, 0.0, 4)


def test_the_hash_reads_values_in_order_not_memory_layout():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    assert not x.t().is_contiguous()
    assert fingerprint(x.t()) == fingerprint(x.t().contiguous())
    assert fingerprint(x.t())["hash"] != fingerprint(x)["hash"]  # another order of the values
    assert fingerprint(x.reshape(-1))["hash"] == fingerprint(x)["hash"]  # same order


@given(
    n=st.integers(2, 300),
    i=st.integers(0, 299),
    j=st.integers(0, 299),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_one_ulp_anywhere_or_a_swap_changes_the_hash(n, i, j, dtype):
    i, j = i % n, j % n
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    y = x.clone()
    y[i] = torch.nextafter(x[i], torch.tensor(math.inf, dtype=dtype))
    fx, fy = fingerprint(x), fingerprint(y)
    assert fx["hash"] != fy["hash"]
    assert fingerprint(x.clone())["hash"] == fx["hash"]  # deterministic
    if x[i] != x[j]:  # the hash weighs each position differently
        z = x.clone()
        z[i], z[j] = x[j], x[i]
        assert fingerprint(z)["hash"] != fx["hash"]


# ---------------------------------------------------------------------------------- compare


def _row(step: int, module: str, phase: str, *, h: int = 0, norm: float = 1.0, bad: int = 0):
    return {"schema_version": 1, "step": step, "module": module, "phase": phase, "sum": 0.0,
            "norm": norm, "absmax": 1.0, "nonfinite": bad, "hash": h}  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # blank lines are skipped
    return path


def _grid(steps: int = 2) -> list[dict]:
    return [
        _row(s, m, ph) for s in range(1, steps + 1) for m in ("a.attn", "b.mlp")
        for ph in ("forward", "backward")
    ]  # fmt: skip


def test_identical_recordings(tmp_path):
    a = _write(tmp_path / "a.jsonl", _grid())
    r = compare(a, _write(tmp_path / "b.jsonl", _grid()))
    assert r["identical"] and r["first_divergence"] is None
    assert (r["compared"], r["only_in_one"]) == (8, 0)
    assert r["max_norm_drift_by_step"] == {1: 0.0, 2: 0.0}


def test_the_first_divergence_is_in_execution_order(tmp_path):
    """Step first, then the forward before the backward, then the module name."""
    b = _grid()
    for k, r in enumerate(b):
        if (r["step"], r["module"], r["phase"]) in {(2, "a.attn", "forward"),
                                                    (1, "a.attn", "backward"),
                                                    (1, "b.mlp", "forward")}:  # fmt: skip
            b[k] = r | {"hash": 1, "norm": 1.25, "nonfinite": 2}
    r = compare(_write(tmp_path / "a.jsonl", _grid()), _write(tmp_path / "b.jsonl", b))
    assert not r["identical"]
    assert r["first_divergence"] == {"step": 1, "module": "b.mlp", "phase": "forward"}
    assert r["max_norm_drift_by_step"] == {1: pytest.approx(0.2), 2: pytest.approx(0.2)}
    assert r["nonfinite"] == {"a": 0, "b": 6}


def test_rows_only_in_one_recording_are_counted_not_compared(tmp_path):
    a = _write(tmp_path / "a.jsonl", _grid(3))
    b = _write(tmp_path / "b.jsonl", [*_grid(2), _row(9, "x", "forward", h=5)])
    r = compare(a, b)
    assert (r["compared"], r["only_in_one"]) == (8, 4 + 1)
    assert r["identical"] and set(r["max_norm_drift_by_step"]) == {1, 2}


_ROWS = st.lists(
    st.builds(
        _row,
        step=st.integers(1, 3),
        module=st.sampled_from(["a", "b"]),
        phase=st.sampled_from(["forward", "backward"]),
        h=st.integers(0, 2),
        norm=st.floats(0.0, 4.0),
        bad=st.integers(0, 2),
    ),
    max_size=12,
)


@given(ra=_ROWS, rb=_ROWS)
def test_the_comparison_is_symmetric(tmp_path_factory, ra, rb):
    d = tmp_path_factory.mktemp("cmp")
    a, b = _write(d / "a.jsonl", ra), _write(d / "b.jsonl", rb)
    ab, ba = compare(a, b), compare(b, a)
    assert ab["nonfinite"] == {"a": ba["nonfinite"]["b"], "b": ba["nonfinite"]["a"]}
    assert {k: v for k, v in ab.items() if k != "nonfinite"} == {
        k: v for k, v in ba.items() if k != "nonfinite"
    }
    assert all(0.0 <= v <= 1.0 for v in ab["max_norm_drift_by_step"].values())
    assert compare(a, a)["identical"]


# --------------------------------------------------------------------------------- Recorder


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(x)


def test_the_recorder_writes_every_boundary_forward_and_backward(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(3, 4)
    with Recorder(model, tmp_path / "sub" / "run.jsonl") as rec:
        for _ in range(2):
            model(x).sum().backward()
        assert rec.step == 2
    with torch.no_grad():
        model(x)  # after exit: nothing recorded, every hook gone
    rows = [json.loads(line) for line in (tmp_path / "sub" / "run.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["module"], r["phase"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 4 * 2  # steps x boundaries x phases
    assert {m for _, m, _ in keys} == {"0.attn", "0.mlp", "1.attn", "1.mlp"}
    assert all(r["schema_version"] == 1 for r in rows)
    want = fingerprint(model[0].self_attn(x))  # the first boundary's output, recomputed
    first = next(r for r in rows if r["module"] == "0.attn" and r["phase"] == "forward")
    assert {k: first[k] for k in want} == want
    # the gradient flowing into 1.mlp's output is d(sum)/d(out) = ones
    grad = next(r for r in rows if r["module"] == "1.mlp" and r["phase"] == "backward")
    assert grad["sum"] == 12.0 and grad["absmax"] == 1.0
    assert not any(m._forward_hooks for m in model.modules())
    assert not model._forward_pre_hooks
