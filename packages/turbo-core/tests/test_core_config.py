"""FSDPTurboConfig: construction, normalisation, loading and every field check."""

import dataclasses

import pytest
import torch

from fsdp_turbo.fsdp_turbo_config import (
    ChunkLossPlanConfig,
    ConfigError,
    EPPlanConfig,
    FSDPPlanConfig,
    FSDPTurboConfig,
    QuantizeConfig,
    TPPlanConfig,
)


def test_seed_quick_start_builds():
    config = FSDPTurboConfig(
        fully_shard_parallel_size=8,
        fsdp_plan=FSDPPlanConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                 num_to_forward_prefetch=1, num_to_backward_prefetch=1),
        tensor_parallel_size=4,
        tp_plan=TPPlanConfig(colwise_parallel=["*.q_proj", "*.k_proj", "*.v_proj"], rowwise_parallel=["*.o_proj"]),
        recompute=True,
        recompute_plan=["model.layers.*"],
    )
    assert config.fsdp_plan.param_dtype is torch.bfloat16
    assert config.tp_plan.colwise_parallel == ("*.q_proj", "*.k_proj", "*.v_proj")
    assert config.recompute_plan == ("model.layers.*",)
    sizes = config.validate(32)
    assert (sizes.dp_replicate, sizes.fsdp, sizes.cp, sizes.tp) == (1, 8, 1, 4)


def test_seed_expert_example_builds():
    config = FSDPTurboConfig(
        expert_parallel_size=2,
        ep_plan=EPPlanConfig(apply_modules=["*mlp.experts*"], dispatcher="fused"),
        quantization_plan=QuantizeConfig(quant_format="E4M3", block_size=32),
    )
    assert config.ep_plan.dispatcher == "fused"
    assert config.quantization_plan.quant_format == "E4M3"


@pytest.mark.parametrize("text,dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                        ("torch.float32", torch.float32), ("fp16", torch.float16)])
def test_dtype_strings(text, dtype):
    assert FSDPPlanConfig(param_dtype=text).param_dtype is dtype


def test_read_only_after_validation():
    config = FSDPTurboConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tensor_parallel_size = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fsdp_plan.param_dtype = torch.float16
    assert isinstance(FSDPPlanConfig(apply_modules=["a"]).apply_modules, tuple)


def test_from_dict_nested_and_round_trip():
    data = {
        "data_parallel_size": 2,
        "fsdp_plan": {"param_dtype": "bfloat16", "apply_modules": ["model.layers.*"]},
        "tensor_parallel_size": 2,
        "tp_plan": {"colwise_parallel": ["*.q_proj"], "rowwise_parallel": ["*.o_proj"]},
    }
    config = FSDPTurboConfig.from_dict(data)
    assert config.fsdp_plan.param_dtype is torch.bfloat16
    again = FSDPTurboConfig.from_dict(config.to_dict())
    assert again == config


def test_from_yaml_and_toml(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "fully_shard_parallel_size: 4\nfsdp_plan:\n  param_dtype: bf16\n  num_to_forward_prefetch: 1\n")
    (tmp_path / "c.toml").write_text(
        "fully_shard_parallel_size = 4\n[fsdp_plan]\nparam_dtype = 'bf16'\nnum_to_forward_prefetch = 1\n")
    from_yaml = FSDPTurboConfig.from_file(tmp_path / "c.yaml")
    from_toml = FSDPTurboConfig.from_file(tmp_path / "c.toml")
    assert from_yaml == from_toml
    assert from_yaml.fsdp_plan.num_to_forward_prefetch == 1
    with pytest.raises(ConfigError, match="path"):
        FSDPTurboConfig.from_file(tmp_path / "c.json")


BAD_FIELDS = [
    (dict(fully_shard_parallel_size=0), "fully_shard_parallel_size"),
    (dict(tensor_parallel_size="2"), "tensor_parallel_size"),
    (dict(data_parallel_size=True), "data_parallel_size"),
    (dict(fsdp_plan={"param_dtype": "bfloat17"}), "fsdp_plan.param_dtype"),
    (dict(fsdp_plan={"param_dtype": torch.int32}), "fsdp_plan.param_dtype"),
    (dict(fsdp_plan={"num_to_forward_prefetch": -1}), "fsdp_plan.num_to_forward_prefetch"),
    (dict(fsdp_plan={"apply_modules": [""]}), "fsdp_plan.apply_modules"),
    (dict(fsdp_plan={"reshard_after_forward": 0}), "fsdp_plan.reshard_after_forward"),
    (dict(fsdp_plan={"prefetch": 1}), "fsdp_plan.prefetch"),
    (dict(tensor_parallel_size=2), "tp_plan"),
    (dict(tensor_parallel_size=2, tp_plan={"loss_parallel": True}), "tp_plan"),
    (dict(tp_plan={"colwise_parallel": ["*.q_proj"], "rowwise_parallel": ["*.q_proj"]}), "tp_plan.rowwise_parallel"),
    (dict(expert_parallel_size=2), "ep_plan"),
    (dict(ep_plan={"num_chunks": 0}), "ep_plan.num_chunks"),
    (dict(ep_plan={"fixed_router": "yes"}), "ep_plan.fixed_router"),
    (dict(ep_plan={"redundant_experts": -1}), "ep_plan.redundant_experts"),
    (dict(ep_plan={"rebalance_every": 0}), "ep_plan.rebalance_every"),
    (dict(router_bias_update_rate=-0.001), "router_bias_update_rate"),
    (dict(model_facts={"attention_function": "noattr"}), "model_facts.attention_function"),
    (dict(model_facts={"attention_function": "a.b", "attention_modules": ["*.attn"]}), "model_facts.attention_modules"),
    (dict(model_facts={"position_input": ""}), "model_facts.position_input"),
    (dict(model_facts={"head_module": ""}), "model_facts.head_module"),
    (dict(model_facts={"ignore_index": "-100"}), "model_facts.ignore_index"),
    (dict(model_facts={"num_attention_heads": 0}), "model_facts.num_attention_heads"),
    (dict(recompute=True, recompute_policy="some"), "recompute_policy"),
    (dict(chunk_loss_plan={"chunk_size": 0}), "chunk_loss_plan.chunk_size"),
    (dict(chunk_loss_plan={"logit_softcap": 0.0}), "chunk_loss_plan.logit_softcap"),
    (dict(quantization_plan={"quant_format": 8}), "quantization_plan.quant_format"),
    (dict(quantization_plan={"block_size": 0}), "quantization_plan.block_size"),
    (dict(quantization_plan={"scale_mode": "ceil"}), "quantization_plan.scale_mode"),
    (dict(quantization_plan={"low_precision_all_gather": "yes"}), "quantization_plan.low_precision_all_gather"),
    (dict(quantization_plan={"low_precision_all_gather_mode": "always"}),
     "quantization_plan.low_precision_all_gather_mode"),
    (dict(compile=True, quantization_plan={"low_precision_all_gather": True}),
     "quantization_plan.low_precision_all_gather"),
    (dict(device_type="tpu"), "device_type"),
    (dict(unknown_field=1), "unknown_field"),
]


@pytest.mark.parametrize("kwargs,field", BAD_FIELDS, ids=[f for _, f in BAD_FIELDS])
def test_bad_field_names_field_value_and_fix(kwargs, field):
    with pytest.raises(ConfigError) as info:
        FSDPTurboConfig.from_dict(kwargs)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.field == field
    assert f"{field}=" in str(error) and "Fix:" in str(error)


def test_quant_format_is_case_insensitive_and_normalised():
    assert QuantizeConfig(quant_format="hif8").quant_format == "HIF8"
    assert QuantizeConfig(scale_mode="RCEIL").scale_mode == "rceil"


def test_recompute_policy_accepts_op_list():
    config = FSDPTurboConfig(recompute=True, recompute_policy=["aten.addmm", "aten.mm"])
    assert config.recompute_policy == ("aten.addmm", "aten.mm")
    assert ChunkLossPlanConfig(z_loss_weight=1).z_loss_weight == 1.0


@pytest.mark.parametrize("kwargs,world,expected", [
    (dict(), 4, (1, 4, 1, 1)),
    (dict(data_parallel_size=2), 4, (2, 2, 1, 1)),
    (dict(fully_shard_parallel_size=2), 2, (1, 2, 1, 1)),
    (dict(tensor_parallel_size=2, tp_plan={"colwise_parallel": ["*.q_proj"]}), 8, (1, 4, 1, 2)),
    (dict(context_parallel_size=2, data_parallel_size=2), 8, (2, 2, 2, 1)),
])
def test_validate_resolves_sizes(kwargs, world, expected):
    sizes = FSDPTurboConfig.from_dict(kwargs).validate(world)
    assert sizes.dense_shape == expected
    assert sizes.world == world


@pytest.mark.parametrize("kwargs,world,field", [
    (dict(fully_shard_parallel_size=3), 4, "fully_shard_parallel_size"),
    (dict(data_parallel_size=2, fully_shard_parallel_size=4), 4, "fully_shard_parallel_size"),
    (dict(data_parallel_size=3), 4, "data_parallel_size*context_parallel_size*tensor_parallel_size"),
    (dict(expert_parallel_size=3, ep_plan={}), 4, "expert_parallel_size"),
    (dict(expert_parallel_size=2, expert_fully_shard_parallel_size=3, ep_plan={}), 4,
     "expert_fully_shard_parallel_size"),
])
def test_validate_rejects_sizes_that_do_not_tile_the_world(kwargs, world, field):
    with pytest.raises(ConfigError) as info:
        FSDPTurboConfig.from_dict(kwargs).validate(world)
    assert info.value.field == field


def test_expert_sizes_are_derived_to_fill_the_world():
    sizes = FSDPTurboConfig(expert_parallel_size=2, ep_plan=EPPlanConfig()).validate(8)
    assert sizes.expert_shape == (1, 4, 2)
    sizes = FSDPTurboConfig(data_parallel_size=2, expert_parallel_size=2, ep_plan=EPPlanConfig()).validate(8)
    assert sizes.expert_shape == (2, 2, 2)
    sizes = FSDPTurboConfig(expert_parallel_size=2, expert_fully_shard_parallel_size=2,
                            ep_plan=EPPlanConfig()).validate(8)
    assert sizes.expert_shape == (2, 2, 2)


def test_config_error_pickles_with_its_fields():
    import pickle

    error = ConfigError("a.b", 3, "use 4", reason="odd")
    again = pickle.loads(pickle.dumps(error))
    assert (again.field, again.value, again.fix, again.reason) == ("a.b", 3, "use 4", "odd")
    assert str(again) == str(error)
