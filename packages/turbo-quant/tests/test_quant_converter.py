"""The converter framework: default picks, explicit picks, errors, MoE experts, the facade."""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
from fsdp_turbo.quantization.converter import Converter, convert_model, register_converter, unregister_converter
from fsdp_turbo.quantization.training import MXLinear
from fsdp_turbo.quantization.training.mx_experts import MXFusedExperts


def _linears(model):
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_default_converts_every_layer_linear_but_not_the_head():
    model = tiny_hf_causal_lm("llama")
    converted = convert_model(model, QuantizeConfig())
    assert set(converted) == _linears(model) - {"lm_head"}
    assert set(converted.values()) == {"mx_linear"}
    assert not isinstance(model.lm_head, MXLinear)


def test_default_skips_dims_that_do_not_divide_the_block():
    model = tiny_hf_causal_lm("llama")  # k_proj / v_proj have 2 kv heads x 16 = 32 out features
    converted = convert_model(model, QuantizeConfig(block_size=64))
    assert "model.layers.0.self_attn.q_proj" in converted
    assert "model.layers.0.self_attn.k_proj" not in converted


def test_explicit_patterns_and_their_errors():
    model = tiny_hf_causal_lm("llama")
    converted = convert_model(model, QuantizeConfig(apply_modules=["model.layers.*"], ignored_modules=["*.mlp"]))
    assert converted and all(".self_attn." in n for n in converted)
    with pytest.raises(ConfigError, match="output head"):
        convert_model(tiny_hf_causal_lm("llama"), QuantizeConfig(apply_modules=["lm_head"]))
    with pytest.raises(ConfigError, match="not divisible"):
        convert_model(tiny_hf_causal_lm("llama"), QuantizeConfig(block_size=64, apply_modules=["*.k_proj"]))
    with pytest.raises(ConfigError, match="matches no module"):
        convert_model(tiny_hf_causal_lm("llama"), QuantizeConfig(apply_modules=["*.nothing"]))
    with pytest.raises(ConfigError, match="no converter by that name"):
        convert_model(tiny_hf_causal_lm("llama"), QuantizeConfig(converters=["fp4_magic"]))
    with pytest.raises(ConfigError, match="no convertible module"):
        convert_model(tiny_hf_causal_lm("llama"), QuantizeConfig(apply_modules=["model.norm"]))


def test_moe_experts_are_converted_and_routers_are_not():
    model = tiny_hf_causal_lm("qwen3_moe")
    converted = convert_model(model, QuantizeConfig())
    assert converted["model.layers.0.mlp.experts"] == "mx_experts"
    assert isinstance(model.model.layers[0].mlp.experts, MXFusedExperts)
    assert not any(n.endswith(".gate") for n in converted)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_a_registered_converter_is_selectable():
    calls = []
    register_converter(Converter("norm_marker", lambda m: type(m).__name__.endswith("RMSNorm"),
                                 lambda m, r: None, lambda m, r: calls.append(m)))
    try:
        converted = convert_model(tiny_hf_causal_lm("llama"), QuantizeConfig(converters=["norm_marker"]))
        assert len(calls) == len(converted) == 5 and set(converted.values()) == {"norm_marker"}
    finally:
        unregister_converter("norm_marker")


def test_facade_converts_first_and_trains():
    model = FSDPTurbo({"quantization_plan": {"quant_format": "hif8"}}, tiny_hf_causal_lm("qwen3"))
    assert isinstance(model.model.layers[1].mlp.down_proj, MXLinear)
    assert model.model.layers[1].mlp.down_proj.mx_recipe.grad_emax_elem == 7
    ids = torch.randint(0, 256, (2, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_what_a_converter_leaves_out_is_named_and_nothing_to_convert_is_an_error(caplog):
    import logging

    from fsdp_turbo.core.model_facts import resolve_model_facts
    from fsdp_turbo.quantization.converter import plan_conversion

    model = tiny_hf_causal_lm("llama")  # k_proj / v_proj: 32 out features
    conversions, skipped = plan_conversion(model, QuantizeConfig(block_size=64), resolve_model_facts(model))
    left = dict(skipped)
    assert "output head" in left["lm_head"]
    assert "out_features=32 not divisible by block_size=64" in left["model.layers.0.self_attn.k_proj"]
    assert not {c.name for c in conversions} & set(left)
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        FSDPTurbo({"quantization_plan": {"block_size": 64}}, tiny_hf_causal_lm("llama"))
    assert any("left 5 module(s) in high precision" in r.getMessage() and "k_proj" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match="it converts nothing"):
        FSDPTurbo({"quantization_plan": {"block_size": 1024}}, tiny_hf_causal_lm("llama"))


def test_gpt_oss_experts_convert_for_training_and_name_what_frozen_storage_lacks():
    """MX training takes gpt-oss's transposed, biased experts; QLoRA-MX storage does not yet:
    left in high precision with that reason, or refused when picked; never a crash."""
    model = tiny_hf_causal_lm("gpt_oss")
    assert convert_model(model, QuantizeConfig(apply_modules=["*mlp.experts"])) == {
        "model.layers.0.mlp.experts": "mx_experts", "model.layers.1.mlp.experts": "mx_experts"}
    frozen = tiny_hf_causal_lm("gpt_oss").requires_grad_(False)
    picked = QuantizeConfig(apply_modules=["*mlp.experts"], store_frozen_weights=True)
    with pytest.raises(ConfigError, match="weights without biases") as error:
        convert_model(frozen, picked)
    assert error.value.field == "quantization_plan.apply_modules"
