"""The public surface: clear errors, policies, and the structures the family table relies on."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from attnchecker import (
    ABFTConfig,
    ConfigError,
    NoMatchingModuleError,
    UncorrectableFaultError,
    UnsupportedModelError,
    protect_,
    unprotect_,
)
from attnchecker.models.families import FAMILIES
from attnchecker.models.registry import discover
from attnchecker.models.tiny import build

from .helpers import attention_layers, batch


def test_transformers_version_is_the_one_the_table_was_written_for():
    assert transformers.__version__.startswith("5.24"), (
        "re-run the contract tests and update the family table"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_contract_of_each_family(family):
    """The structures the table entries rely on. If transformers changes them, this fails loudly."""
    model = build(family)
    blocks = discover(model).blocks
    assert [b.layer for b in blocks] == attention_layers(model)
    for b in blocks:
        kinds = {type(p.module).__name__ for p in b.projections}
        assert kinds <= {"Linear", "Conv1D"}
        assert sorted(s for p in b.projections for s in p.sites) == sorted(["q", "k", "v", "out"])
    core = blocks[0].core
    if family == "gpt2":
        assert blocks[0].projections[0].module.weight.shape == (32, 96)  # Conv1D: (in, 3 * out)
        assert hasattr(core, "reorder_and_upcast_attn") and hasattr(core, "scaling")
    if family == "gpt_neo":
        assert callable(core._attn) and core.bias.dtype == torch.bool
        assert [b.core.attention_type for b in blocks] == ["global", "local"]
    if family == "llama":
        assert core.num_key_value_groups == 2 and core.k_proj.out_features == 16


def test_unsupported_model_names_the_supported_families():
    with pytest.raises(UnsupportedModelError, match=r"not a transformers model.*bart, bert, dis"):
        protect_(nn.Linear(3, 3), example=(torch.randn(2, 3),))
    model = nn.Linear(3, 3)
    protect_(model)  # found at its first forward, which raises the same
    with pytest.raises(UnsupportedModelError, match=r"not a transformers model.*bart, bert, dis"):
        model(torch.randn(2, 3))
    cfg = transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=50)
    model = transformers.AutoModel.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="BloomAttention"):
        protect_(model)


def test_config_matching_nothing():
    with pytest.raises(NoMatchingModuleError, match="indices"):
        protect_(build("bert"), ABFTConfig(layers=(7,)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ops": ("q", "qk")}, "unknown ops"),
        ({"ops": "q"}, "tuple of op names"),
        ({"mode": "fast"}, "mode must be"),
        ({"policy": "ignore"}, "policy must be"),
        ({"max_rows": 0}, "positive integer"),
        ({"tolerance_scale": 0.5}, ">= 1"),
        ({"layers": (-1,)}, "non-negative"),
    ],
)
def test_bad_config_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ABFTConfig(**kwargs)


def test_protect_twice_and_unprotect_unprotected():
    model = build("gpt2")
    protect_(model)
    with pytest.raises(ConfigError, match="already protected"):
        protect_(model)
    unprotect_(model)
    with pytest.raises(ConfigError, match="not protected"):
        unprotect_(model)


def _uncorrectable(policy):
    """NaN in three heads of the scores with max_heads=1: beyond the repair budget."""
    model = build("bert")
    handle = protect_(model, ABFTConfig(policy=policy, max_heads=1))
    handle.attach(
        lambda c: c.tensor[:, :3, 2, 2].fill_(float("nan")) if c.site == "scores" else None
    )
    model(**batch("bert"))
    return handle


def test_policy_raise():
    handle = _uncorrectable("raise")
    with pytest.raises(UncorrectableFaultError, match="uncorrectable") as err:
        handle.drain()
    assert handle.drain() == []  # drained even when raising
    # ... and the events survive on the exception, as the counters keep them
    assert {(e.op, e.action) for e in err.value.events} >= {("scores", "uncorrectable")}
    assert handle.counters()["scores"]["uncorrectable"] >= 1


def test_policy_warn_and_skip_step():
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        events = _uncorrectable("warn").drain()
    assert {e.action for e in events} == {"uncorrectable"}
    handle = _uncorrectable("skip_step")
    assert handle.drain() and handle.skip_requested
    assert handle.drain() == [] and not handle.skip_requested


def test_summary_is_plain_data():
    model = build("gpt_neo")
    handle = protect_(model)
    model(**batch("gpt_neo"))
    s = handle.summary()
    assert s["steps"] == 1 and s["mode"] == "naive" and len(s["modules"]) == 2
    assert s["counters"]["scores"] == {"detected": 0, "corrected": 0, "uncorrectable": 0}


def test_the_docs_list_the_families_of_the_table():
    """The reference's list of supported families is the table's, and the README counts them,
    so neither can drift."""
    from pathlib import Path

    from attnchecker.models.families import TABLE

    root = Path(__file__).parents[2]
    page = (root / "docs" / "protect.md").read_text()
    listed = page.split("<!-- families -->")[1].split("<!-- /families -->")[0]
    assert [f.strip() for f in listed.split(",")] == list(TABLE)
    assert f"{len(TABLE)} families" in (root / "README.md").read_text()
