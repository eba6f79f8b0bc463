"""Unit selection and the prefetch plan, in one process."""

import pytest
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.fully_shard_parallel import select_units
from fsdp_turbo.distributed.fully_shard_parallel.units import prefetch_plan
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_default_units_are_the_decoder_layers(kind):
    model = tiny_hf_causal_lm(kind, num_hidden_layers=3)
    assert list(select_units(model, FSDPPlanConfig()).units) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_patterns_pick_outermost_units():
    model = tiny_hf_causal_lm("llama", num_hidden_layers=4)
    plan = FSDPPlanConfig(apply_modules=["model.layers.{1-2}*", "model.embed_tokens"],
                          ignored_modules=["model.layers.0.mlp"])
    selection = select_units(model, plan)
    assert list(selection.units) == ["model.embed_tokens", "model.layers.1", "model.layers.2"]
    assert list(selection.ignored) == ["model.layers.0.mlp"]
    assert selection.ignored_params() == set(model.model.layers[0].mlp.parameters())


def test_ignoring_a_unit_or_its_parent_is_an_error():
    model = tiny_hf_causal_lm("llama")
    with pytest.raises(ConfigError, match=r"contains the FSDP unit 'model\.layers\.0'"):
        select_units(model, FSDPPlanConfig(ignored_modules=["model.layers.0"]))
    with pytest.raises(ConfigError, match="contains the FSDP unit"):
        select_units(model, FSDPPlanConfig(ignored_modules=["model"]))


def test_prefetch_plan_neighbours():
    units = [nn.Linear(1, 1) for _ in range(4)]
    plan = {i: (ahead, behind) for i, ahead, behind in prefetch_plan(units, forward=2, backward=1)}
    assert plan[0] == (units[1:3], [])
    assert plan[2] == ([units[3]], [units[1]])
    assert plan[3] == ([], [units[2]])
    assert all(not a and not b for _, a, b in prefetch_plan(units, 0, 0))
