"""Zero false alarms over clean training under real dynamics (``attnchecker.testing.clean_run``):
every family of the table, fp32 and bf16 autocast (every linear layer, and fp16 too, for three),
AdamW at a high learning rate with every norm weight moving, outlier embedding features. The
default run trains a few steps of each; the slow one more than 2,000 steps in all
(``benchmarks/clean_false_alarms.py`` reports the same count).
"""

from __future__ import annotations

import pytest

from attnchecker.models.families import FAMILIES
from attnchecker.testing import clean_run


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_clean_training_raises_no_event(family, dtype):
    run = clean_run(family, dtype=dtype, steps=4)
    assert run.events == 0, run
    assert run.norm_drift > 0.01  # the norm weights did move off their initial values


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_clean_training_of_every_linear_layer_raises_no_event(family, dtype):
    """scope="all_linear" (MLP and LM head too, forward and backward), fp16 autocast as well."""
    run = clean_run(family, dtype=dtype, steps=3, scope="all_linear")
    assert run.events == 0, run


@pytest.mark.slow
def test_two_thousand_clean_steps_raise_no_event():
    runs = [clean_run(f, dtype=d, steps=70) for f in FAMILIES for d in ("fp32", "bf16")]
    assert sum(r.steps for r in runs) >= 2000
    assert [r for r in runs if r.events] == []
    stuck = [r for r in runs if not (r.norm_drift > 0.05 and r.loss_last < r.loss_first)]
    assert stuck == [], stuck  # real dynamics: every run learned and moved its norm weights
