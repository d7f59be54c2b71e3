"""models.registry.discover on every family and size: the attention blocks it finds are the
modules the table's wiring names, with the head counts of the config; ``probe`` tells the eager
math apart; ``layer_of`` is one rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from attnchecker.attention.core import CoreSpec
from attnchecker.models.families import FAMILIES, TABLE
from attnchecker.models.registry import discover, layer_of, probe
from attnchecker.models.tiny import build

from .test_table import SITE_EXPANSION


def _module(model: nn.Module, name: str) -> nn.Module:
    return dict(model.named_modules())[name]


def _expected_blocks(model: nn.Module, layers: int) -> int:
    """One attention module per layer; an encoder-decoder's decoder has two (self, cross)."""
    return 3 * layers if model.config.is_encoder_decoder else layers


@pytest.mark.parametrize("size", ["small", "base"])  # tiny: tests/unit/models/test_families.py
@pytest.mark.parametrize("family", FAMILIES)
def test_discovery_finds_the_wired_projections_with_the_configs_heads(family, size):
    """One layer per model keeps this cheap: the sizes differ by width and heads."""
    fam = TABLE[family]
    model = build(family, size, layers=1)
    cfg = model.config
    hidden, heads = getattr(cfg, fam.keys[0]), getattr(cfg, fam.keys[2])
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    found = discover(model)
    assert (found.model_type, found.generic, found.wiring) == (family, False, fam.wiring)
    assert len(found.blocks) == _expected_blocks(model, 1)
    for b in found.blocks:
        assert b.layer == 0 and b.spec == fam.wiring.spec and b.passing == fam.wiring.passing
        assert _module(model, b.name) is b.core
        owner = b.name.removesuffix(f".{fam.wiring.core}") if fam.wiring.core else b.name
        parent = _module(model, owner)
        paths = fam.wiring.cross if getattr(parent, "is_cross_attention", False) else None
        paths = paths or fam.wiring.projections
        assert len(b.projections) == len(paths)
        for p, path in zip(b.projections, paths, strict=True):
            sub, _, sites = path.partition(":")
            assert p.module is parent.get_submodule(sub), (b.name, path)
            assert p.sites == SITE_EXPANSION[sites]
        heads_of = {s: n for p in b.projections for s, n in p.heads.items()}
        assert heads_of == {"q": heads, "k": kv_heads, "v": kv_heads, "out": heads}, b.name
        assert hidden % heads == 0


def test_gpt2_cross_attention_takes_the_cross_wiring():
    model = build("gpt2", add_cross_attention=True)
    blocks = discover(model).blocks
    cross = [b for b in blocks if b.core.is_cross_attention]
    assert len(cross) == model.config.n_layer and len(blocks) == 2 * model.config.n_layer
    for b in cross:
        assert [p.sites for p in b.projections] == [("q",), ("k", "v"), ("out",)]
        assert b.projections[0].module is b.core.q_attn and b.projections[0].conv1d


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_probe_accepts_the_tables_math_and_refuses_another(family):
    block = discover(build(family)).blocks[0]
    assert probe(block.core, block.spec, block.projections)
    unscaled = CoreSpec(**{**block.spec.__dict__, "scale": not block.spec.scale})
    assert not probe(block.core, unscaled, block.projections)


def test_probe_leaves_the_module_mode_as_it_was():
    block = discover(build("llama")).blocks[0]
    block.core.eval()
    probe(block.core, block.spec, block.projections)
    assert not block.core.training


_PART = st.text("abcdefghij_", min_size=1, max_size=6)


@given(
    before=st.lists(_PART, max_size=3),
    index=st.integers(0, 999),
    after=st.lists(st.one_of(_PART, st.integers(0, 99).map(str)), max_size=3),
)
def test_layer_of_is_the_first_index_in_the_name(before, index, after):
    name = ".".join([*before, str(index), *after])
    assert layer_of(name) == index
    assert layer_of(".".join(before) or "lm_head", None, 7) == 7  # no index: the default
    m = nn.Identity()
    m.layer_id = index + 1  # GPT-Neo's attribute: the module's own index wins
    assert layer_of(name, m) == index + 1
