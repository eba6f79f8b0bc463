"""The wildcard matcher: semantics, outermost rule, no-match and conflict errors."""

import pytest
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.patterns import check_disjoint, compile_pattern, match_modules, outermost_only


@pytest.mark.parametrize("pattern,name,hit", [
    ("*.q_proj", "model.layers.0.self_attn.q_proj", True),
    ("*.q_proj", "q_proj", False),
    ("*q_proj", "q_proj", True),
    ("model.layers.*", "model.layers.0", True),
    ("model.layers.*", "model.layers.0.mlp", True),
    ("model.layers.*", "model.layers", False),
    ("model.layers.?", "model.layers.7", True),
    ("model.layers.?", "model.layers.12", False),
    ("model.layers.{*}", "model.layers.12", True),
    ("model.layers.{*}", "model.layers.12.mlp", False),
    ("model.layers.{*}", "model.layers.x", False),
    ("model.layers.{0-3}", "model.layers.3", True),
    ("model.layers.{0-3}", "model.layers.4", False),
    ("model.layers.{2-11}.mlp", "model.layers.10.mlp", True),
    ("model.layers.{2-11}.mlp", "model.layers.1.mlp", False),
    ("*mlp.experts*", "model.layers.0.mlp.experts", True),
    ("*mlp.experts*", "model.layers.0.mlp.experts.3.up", True),
    ("lm_head", "lm_head", True),
    ("lm_head", "model.lm_head", False),
    ("a.b", "aXb", False),
    ("a+b", "a+b", True),
])
def test_pattern_semantics(pattern, name, hit):
    assert compile_pattern(pattern).matches(name) is hit


@pytest.mark.parametrize("bad", ["", "model.{1-x}", "model.{3-1}", "a{b"])
def test_malformed_patterns(bad):
    with pytest.raises(ValueError):
        compile_pattern(bad)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


class Net(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(4, 2)


def test_match_modules_in_model_order():
    hits = match_modules(Net(), ["*.q_proj"], field="f")
    assert list(hits) == [f"layers.{i}.q_proj" for i in range(4)]


def test_outermost_rule_wraps_each_block_once():
    hits = match_modules(Net(), ["layers.*"], field="recompute_plan", outermost=True)
    assert list(hits) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    nested = match_modules(Net(), ["layers.*"], field="f")
    assert "layers.0.mlp.0" in nested


def test_outermost_only_keeps_order():
    modules = {"b.1": nn.Linear(1, 1), "a": nn.Linear(1, 1), "a.x": nn.Linear(1, 1)}
    assert list(outermost_only(modules)) == ["b.1", "a"]


def test_range_pattern_picks_a_subset():
    hits = match_modules(Net(), ["layers.{1-2}"], field="f")
    assert list(hits) == ["layers.1", "layers.2"]


def test_pattern_matching_nothing_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        match_modules(Net(), ["*.q_proj", "*.k_proj"], field="tp_plan.colwise_parallel")
    assert info.value.field == "tp_plan.colwise_parallel"
    assert info.value.value == "*.k_proj"
    assert "matches no module" in str(info.value)


def test_module_filter_restricts_candidates():
    hits = match_modules(Net(), ["layers.0*"], field="f", module_filter=lambda n, m: isinstance(m, nn.Linear))
    assert all(isinstance(m, nn.Linear) for m in hits.values())
    with pytest.raises(ConfigError):
        match_modules(Net(), ["layers.0"], field="f", module_filter=lambda n, m: isinstance(m, nn.Linear))


def test_conflicting_plans_are_a_config_error():
    check_disjoint({"colwise": ["a.q"], "rowwise": ["a.o"]})
    with pytest.raises(ConfigError) as info:
        check_disjoint({"tp_plan.colwise_parallel": ["a.q"], "tp_plan.rowwise_parallel": ["a.o", "a.q"]})
    assert info.value.field == "tp_plan.rowwise_parallel"
    assert "tp_plan.colwise_parallel" in str(info.value)
