"""The family table (models.families), the tiny presets (models.tiny) and discovery
(models.registry) checked against each other, family by family, without protecting anything."""

import pytest
from torch import nn

from attnchecker.errors import ConfigError, UnsupportedModelError
from attnchecker.models.families import FAMILIES, TABLE
from attnchecker.models.registry import discover, layer_of, transformer_blocks
from attnchecker.models.tiny import SIZES, build, family_config


def test_the_table_is_keyed_by_model_type_and_lists_every_family():
    assert tuple(TABLE) == FAMILIES and len(FAMILIES) == len(set(FAMILIES))
    assert "tiny" in SIZES


@pytest.mark.parametrize("family", FAMILIES)
def test_each_tiny_model_is_discovered_as_its_table_says(family):
    model = build(family)
    assert model.config.model_type == family
    found = discover(model)
    blocks = found.blocks
    assert blocks, family
    n_layers = family_config(family).num_hidden_layers
    # one attention module per layer (two for an encoder-decoder's decoder: self and cross)
    assert len(blocks) >= n_layers
    assert {b.layer for b in blocks} == set(range(n_layers))
    for b in blocks:
        sites = [s for p in b.projections for s in p.sites]
        assert sorted(set(sites)) == sorted(sites), (family, b.name)  # no site twice
        assert {"q", "out"} <= set(sites) and b.layer == layer_of(b.name, b.core, b.layer)
        for p in b.projections:
            assert sum(p.heads.values()) == p.groups
    assert [t.layer for t in transformer_blocks(model)][:n_layers] == list(range(n_layers))


def test_an_unknown_model_is_refused_naming_the_supported_families():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        discover(model)


def test_a_bad_family_or_size_is_a_config_error():
    with pytest.raises(ConfigError):
        family_config("nope")
    with pytest.raises(ConfigError):
        family_config("gpt2", "huge")


@pytest.mark.parametrize(
    ("name", "attr", "want"),
    [
        ("model.layers.3.mlp.down_proj", None, 3),
        ("lm_head", None, -1),
        ("h.0.attn", 5, 5),  # the module's own layer_idx wins over its name
    ],
)
def test_one_layer_rule(name, attr, want):
    module = nn.Linear(2, 2)
    if attr is not None:
        module.layer_idx = attr
    assert layer_of(name, module) == want
