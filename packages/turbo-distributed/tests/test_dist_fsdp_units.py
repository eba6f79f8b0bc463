"""Unit selection and the prefetch plan, in one process."""

import pytest
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.fully_shard_parallel import select_units
from fsdp_turbo.distributed.fully_shard_parallel.units import prefetch_plan
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig


def _blocks(model):
    return resolve_model_facts(model).blocks

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_default_units_are_the_decoder_layers(kind):
    model = tiny_hf_causal_lm(kind, num_hidden_layers=3)
    units = select_units(model, FSDPPlanConfig(), _blocks(model)).units
    assert list(units) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_patterns_pick_outermost_units():
    model = tiny_hf_causal_lm("llama", num_hidden_layers=4)
    plan = FSDPPlanConfig(apply_modules=["model.layers.{1-2}*", "model.embed_tokens"],
                          ignored_modules=["model.layers.0.mlp"])
    selection = select_units(model, plan, _blocks(model))
    assert list(selection.units) == ["model.embed_tokens", "model.layers.1", "model.layers.2"]
    assert list(selection.ignored) == ["model.layers.0.mlp"]
    assert selection.ignored_params() == set(model.model.layers[0].mlp.parameters())


def test_ignoring_a_unit_or_its_parent_is_an_error():
    model = tiny_hf_causal_lm("llama")
    with pytest.raises(ConfigError, match=r"contains the FSDP unit 'model\.layers\.0'"):
        select_units(model, FSDPPlanConfig(ignored_modules=["model.layers.0"]), _blocks(model))
    with pytest.raises(ConfigError, match="contains the FSDP unit"):
        select_units(model, FSDPPlanConfig(ignored_modules=["model"]), _blocks(model))


def test_prefetch_plan_neighbours():
    units = [nn.Linear(1, 1) for _ in range(4)]
    plan = {i: (ahead, behind) for i, ahead, behind in prefetch_plan(units, forward=2, backward=1)}
    assert plan[0] == (units[1:3], [])
    assert plan[2] == ([units[3]], [units[1]])
    assert plan[3] == ([], [units[2]])
    assert all(not a and not b for _, a, b in prefetch_plan(units, 0, 0))


def test_the_plan_names_who_prefetches_whom():
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.distributed.fully_shard_parallel import plan_fully_shard
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    model = tiny_hf_causal_lm("qwen3_moe", num_hidden_layers=3)
    state = ParallelState(FSDPTurboConfig().validate(4), 0, "cpu", distributed=True)
    experts = tuple(f"model.layers.{i}.mlp.experts" for i in range(3))
    settings = FSDPPlanConfig(apply_modules=["model.layers.*", "lm_head"], num_to_forward_prefetch=1,
                              num_to_backward_prefetch=2)
    plan = plan_fully_shard(model, settings, state, resolve_model_facts(model), experts=experts, chunked_head="lm_head")
    layer = "model.layers.{}".format
    assert plan.units == (layer(0), layer(1), layer(2), "lm_head") and plan.shards == 4
    # Forward: the next unit and the experts inside it; backward: the previous two, experts first.
    assert plan.forward_prefetch == ((layer(0), (layer(1), experts[1])), (layer(1), (layer(2), experts[2])),
                                     (layer(2), ("lm_head",)))
    assert plan.backward_prefetch == ((layer(1), (experts[0], layer(0))),
                                      (layer(2), (experts[1], layer(1), experts[0], layer(0))),
                                      ("lm_head", (experts[2], layer(2), experts[1], layer(1))),
                                      ("", (layer(2),)))  # the root skips the chunked-loss head


def _one_process_bf16() -> dict:
    import os

    import torch

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(name, None)
    model = FSDPTurbo({"fsdp_plan": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}},
                      tiny_hf_causal_lm("llama"))
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda module, args: seen.append((module.weight.dtype, args[0].dtype)))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return {"seen": seen, "plans": list(model.fsdp_turbo_plans), "world": model.parallel_state.world_size,
            "grad": model.model.layers[0].self_attn.q_proj.weight.grad.dtype}


def test_fsdp_plan_applies_in_a_single_process():
    """A one-GPU user asking for bf16 gets bf16: a one-rank FSDP2, no launcher needed."""
    import torch

    from fsdp_turbo.core.testing import run_reference

    result = run_reference(_one_process_bf16, timeout=120)
    assert result["plans"] == ["fully_shard"] and result["world"] == 1
    assert result["seen"] == [(torch.bfloat16, torch.bfloat16)]
    assert result["grad"] == torch.float32  # fp32 master weights, gradients reduced in fp32


def test_kept_units_are_named_units():
    model = tiny_hf_causal_lm("llama", num_hidden_layers=2)
    plan = FSDPPlanConfig(apply_modules=["model.layers.*", "lm_head"], keep_after_forward=["lm_head"])
    assert select_units(model, plan, _blocks(model)).kept == ("lm_head",)
    assert select_units(model, FSDPPlanConfig(), _blocks(model)).kept == ()
    with pytest.raises(ConfigError, match=r"fsdp_plan\.keep_after_forward.*not an FSDP unit"):
        select_units(model, FSDPPlanConfig(keep_after_forward=["lm_head"]), _blocks(model))


def test_unit_groups_make_one_unit_in_model_order():
    model = tiny_hf_causal_lm("llama", num_hidden_layers=2)
    plan = FSDPPlanConfig(apply_modules=["model.layers.*"], unit_groups=[["model.norm", "lm_head"]],
                          keep_after_forward=["lm_head"])
    selection = select_units(model, plan, _blocks(model))
    assert list(selection.units) == ["model.layers.0", "model.layers.1", "model.norm"]
    assert selection.groups == {"model.norm": ("model.norm", "lm_head")}
    assert selection.kept == ("model.norm",)  # the group that holds lm_head
    with pytest.raises(ConfigError, match=r"fsdp_plan\.unit_groups.*two FSDP units"):
        plan = FSDPPlanConfig(apply_modules=["model.layers.*"], unit_groups=[["model.layers.1.mlp"]])
        select_units(model, plan, _blocks(model))
    with pytest.raises(ConfigError, match=r"fsdp_plan\.unit_groups"):
        FSDPPlanConfig(unit_groups="model.norm")
