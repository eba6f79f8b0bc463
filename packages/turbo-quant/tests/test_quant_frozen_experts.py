"""QLoRA-MX for fused MoE experts (``store_frozen_weights``): packed 3-D expert weights, their
numerics against the same quantization in high-precision experts, the stored form, and the plan.

EP=2 x efsdp 2 parity (every dispatcher) against PEFT is in ``integration_tests/test_integ_qlora_moe.py``.
"""

import copy

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
from fsdp_turbo.quantization.converter import convert_model, plan_conversion
from fsdp_turbo.quantization.frozen import MXFrozenExperts, MXPackedLastDim, frozen_weight_values, to_mx_frozen_experts
from fsdp_turbo.quantization.training.recipe import MXRecipe

EXPERTS = ["*.mlp.experts"]
WEIGHTS = ("gate_up_proj", "down_proj")


def _frozen_moe(**overrides) -> nn.Module:
    return tiny_hf_causal_lm("qwen3_moe", **overrides).requires_grad_(False)


def _routing(experts: nn.Module, tokens: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, experts.hidden_dim, generator=g)
    index = torch.randint(0, experts.num_experts, (tokens, 2), generator=g)
    return hidden, index, torch.rand(tokens, 2, generator=g)


def test_frozen_experts_store_one_byte_per_element_and_one_per_block():
    model = _frozen_moe()
    converted = convert_model(model, QuantizeConfig(apply_modules=EXPERTS, store_frozen_weights=True))
    assert converted == {f"model.layers.{i}.mlp.experts": "mx_frozen_experts" for i in range(2)}
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, MXFrozenExperts)
    # [E, 2I, H] / [E, H, I] -> blocks of 32 along the last dim, each 32 code bytes and 1 scale byte
    assert experts.gate_up_proj.shape == (8, 64, 66) and experts.down_proj.shape == (8, 64, 33)
    for name, elements in (("gate_up_proj", 8 * 64 * 64), ("down_proj", 8 * 64 * 32)):
        packed = getattr(experts, name)
        assert packed.dtype == torch.uint8 and not packed.requires_grad
        assert packed.numel() * packed.element_size() == elements * (1 + 1 / 32)


@pytest.mark.parametrize("quant_format", ["E4M3", "HIF8"])
def test_frozen_experts_compute_exactly_what_experts_with_the_reference_quantization_do(quant_format):
    """The reference: the same experts (transformers' own forward) with each weight replaced by the
    values ``frozen_weight_values`` gives (quantized by the same function, then dequantized)."""
    recipe = MXRecipe.from_config(QuantizeConfig(quant_format=quant_format, store_frozen_weights=True))
    experts = _frozen_moe().model.layers[0].mlp.experts
    reference = copy.deepcopy(experts)
    with torch.no_grad():
        for name in WEIGHTS:
            getattr(reference, name).copy_(frozen_weight_values(getattr(reference, name), recipe))
    to_mx_frozen_experts(experts, recipe)
    hidden, index, weights = _routing(experts)
    outs, grads = [], []
    for module in (experts, reference):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(x, index, w)
        out.square().sum().backward()
        outs.append(out)
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for ours, theirs in zip(*grads, strict=True):  # to the input and to the routing weights
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert all(getattr(experts, n).grad is None for n in WEIGHTS)


def test_a_box_of_packed_experts_cut_on_block_edges_is_the_packing_of_the_same_box_of_the_weight():
    """EP keeps whole experts, expert FSDP cuts dim 0 or 1: every such box of the packed bytes is the
    packing of its box of the weight, and the form maps the one box to the other."""
    form = MXPackedLastDim(MXRecipe("E4M3"), torch.float32)
    weight = torch.randn(4, 6, 64) * 3
    packed = form.encode(weight)
    assert packed.shape == (4, 6, 66)
    assert form.values_box((2, 3, 33), (2, 3, 33)) == ((2, 3, 32), (2, 3, 32))
    torch.testing.assert_close(packed[2:, 3:, 33:], form.encode(weight[2:, 3:, 32:]), rtol=0, atol=0)
    torch.testing.assert_close(form.decode(packed[2:, 3:], torch.float32),
                               form.decode(packed, torch.float32)[2:, 3:], rtol=0, atol=0)
    torch.testing.assert_close(form.decode(packed, torch.float32), frozen_weight_values(weight, form.recipe),
                               rtol=0, atol=0)
    assert form.encode(weight[:0]).shape == (0, 6, 66)  # an empty shard
    with pytest.raises(ValueError, match="whole blocks of 33 bytes"):
        form.values_box((0, 0, 5), (4, 6, 33))


def test_meta_built_experts_become_meta_packed_parameters_with_their_stored_forms():
    """Quantized when a checkpoint is loaded (``load_pretrained`` encodes each rank's box through the form)."""
    model = _frozen_moe(device="meta")
    convert_model(model, QuantizeConfig(apply_modules=EXPERTS, store_frozen_weights=True))
    experts = model.model.layers[1].mlp.experts
    for name, values in (("gate_up_proj", (8, 64, 64)), ("down_proj", (8, 64, 32))):
        packed, form = getattr(experts, name), experts.stored_forms[name]
        assert packed.is_meta and packed.dtype == torch.uint8
        assert form.values_dtype == torch.float32
        assert form.values_box((0, 0, 0), tuple(packed.shape)) == ((0, 0, 0), values)


class ExpertAdapters(nn.Module):
    """The shape of PEFT's ParamWrapper (LoRA on the experts' fused weights, ``target_parameters``),
    built here so that no peft is needed: a tuner layer holding the experts as ``base_layer``."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.base_layer = experts
        self.lora_A = nn.Linear(experts.hidden_dim, 4 * experts.num_experts, bias=False)

    def forward(self, *args):
        return self.base_layer(*args)


def test_what_cannot_store_its_experts_mx_is_refused_or_left_out():
    plan = QuantizeConfig(apply_modules=EXPERTS, store_frozen_weights=True)
    with pytest.raises(ConfigError, match=r"store_frozen_weights=True.*mlp\.experts's gate_up_proj, down_proj train"):
        convert_model(tiny_hf_causal_lm("qwen3_moe"), plan)  # full fine-tuning
    lora = _frozen_moe()
    lora.model.layers[0].mlp.experts = ExpertAdapters(lora.model.layers[0].mlp.experts)
    with pytest.raises(ConfigError, match=r"store_frozen_weights=True.*ignored_modules.*LoraConfig\.target_parameters"):
        convert_model(lora, plan)
    with pytest.raises(ConfigError, match="intermediate=32 not divisible by block_size=64"):
        convert_model(_frozen_moe(), QuantizeConfig(apply_modules=EXPERTS, block_size=64, store_frozen_weights=True))
    with pytest.raises(ConfigError, match="set store_frozen_weights"):
        convert_model(_frozen_moe(), QuantizeConfig(converters=["mx_frozen_experts"]))
    # by default, experts whose dims do not divide the block are left out (a rank-0 warning), the rest converts
    model = _frozen_moe()
    conversions, skipped = plan_conversion(model, QuantizeConfig(block_size=64, store_frozen_weights=True),
                                           resolve_model_facts(model))
    assert {c.converter for c in conversions} == {"mx_frozen_linear"}
    assert [why for name, why in skipped if name.endswith("mlp.experts")] == [
        "intermediate=32 not divisible by block_size=64"] * 2


def _saved_3d(module: nn.Module, *routing) -> list[tuple[torch.dtype, int]]:
    """The dtype and storage of each 3-D tensor autograd saves in ``module``'s forward (the weights:
    the activations are 2-D)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module(routing[0].requires_grad_(), *routing[1:])
    return sorted((t.dtype, t.untyped_storage().data_ptr()) for t in saved if t.dim() == 3)


def _weights_3d(module: nn.Module) -> list[tuple[torch.dtype, int]]:
    return sorted((w.dtype, w.untyped_storage().data_ptr()) for w in (module.gate_up_proj, module.down_proj))


def test_the_backward_keeps_the_packed_bytes_not_dequantized_weights():
    """What autograd holds from the forward to the backward: high-precision experts hold their weights
    (under FSDP the all-gathered storage, freed after the forward and gathered again); frozen MX experts
    hold their packed bytes in the same place, and no dequantized weight."""
    experts = _frozen_moe().model.layers[0].mlp.experts
    assert _saved_3d(experts, *_routing(experts)) == _weights_3d(experts)
    to_mx_frozen_experts(experts, MXRecipe("E4M3"))
    saved = _saved_3d(experts, *_routing(experts))
    assert saved == _weights_3d(experts) and {dtype for dtype, _ in saved} == {torch.uint8}
