"""The SDC boundaries come from the family table (``Family.sublayers``), and "which layer" from
one rule (``models.registry.layer_of``) shared with protection's discovery."""

from __future__ import annotations

import pytest
from torch import nn

from attnchecker.errors import ConfigError
from attnchecker.models.families import FAMILIES, TABLE
from attnchecker.models.registry import discover, layer_of, transformer_blocks
from attnchecker.models.tiny import build
from attnchecker.sdc import boundaries


def test_layer_of_takes_the_modules_own_index_then_the_name_then_the_default():
    m = nn.Linear(2, 2)
    assert layer_of("model.layers.3.mlp.down_proj") == 3
    assert layer_of("model.layers.3.mlp.down_proj", m) == 3
    assert layer_of("lm_head") == -1 and layer_of("lm_head", m, 7) == 7
    m.layer_idx = 5
    assert layer_of("model.layers.3.self_attn", m) == 5


@pytest.mark.parametrize("family", ["bert", "gpt2", "opt", "llama"])
def test_each_boundary_is_the_tables_child_and_holds_the_attention_discovery_finds(family):
    model = build(family)
    attn, mlp = TABLE[family].sublayers
    names = {id(m): n for n, m in model.named_modules()}
    attention = {b.layer: b.name for b in discover(model).blocks}
    for b in transformer_blocks(model):
        assert names[id(b.attention)] == f"{b.name}.{attn}"
        assert names[id(b.mlp)] == f"{b.name}.{mlp}"
        assert attention[b.layer].startswith(names[id(b.attention)])


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_a_model_type_outside_the_table_takes_the_tables_generic_rule(family):
    model = build(family)
    want = [(layer, kind) for _, layer, kind, _ in boundaries(model)]
    model.config.model_type = "not_in_the_table"
    assert model.config.model_type not in FAMILIES
    assert [(layer, kind) for _, layer, kind, _ in boundaries(model)] == want


def test_plain_modules_have_blocks_by_child_names_or_none():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = nn.Linear(2, 2), nn.Linear(2, 2)

    model = nn.Sequential(Block(), Block())
    assert [(n, layer, kind) for n, layer, kind, _ in boundaries(model)] == [
        ("0.attn", 0, "attention"), ("0.mlp", 0, "mlp"),
        ("1.attn", 1, "attention"), ("1.mlp", 1, "mlp"),
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="no transformer blocks"):
        boundaries(nn.Sequential(nn.Linear(2, 2)))
