"""QLoRA-MX storage (``store_frozen_weights``): the packed MX weight, its numerics and the plan's errors.

FSDP=4 parity against PEFT and the all-gather bytes are in ``integration_tests/test_integ_peft.py``.
"""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
from fsdp_turbo.quantization.converter import convert_model
from fsdp_turbo.quantization.frozen import MXFrozenLinear, MXPackedRows, frozen_weight_values, pack_mx, unpack_mx
from fsdp_turbo.quantization.mx_formats import quantize_mx
from fsdp_turbo.quantization.training import MXLinear
from fsdp_turbo.quantization.training.recipe import MXRecipe


class AdaptedLinear(nn.Module):
    """A LoRA-shaped tuner layer (``base_layer`` + trainable adapters), built here so that no peft is needed."""

    def __init__(self, in_features: int, out_features: int, r: int = 4) -> None:
        super().__init__()
        self.base_layer = nn.Linear(in_features, out_features)
        self.base_layer.requires_grad_(False)
        self.lora_A = nn.Linear(in_features, r, bias=False)
        self.lora_B = nn.Linear(r, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def _adapted_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(AdaptedLinear(64, 96), nn.ReLU(), AdaptedLinear(96, 32))


@pytest.mark.parametrize("quant_format", ["E4M3", "E5M2", "HIF8"])
def test_packed_weight_round_trips_to_the_same_codes_and_scales(quant_format):
    weight = torch.randn(48, 96) * 3
    mx = quantize_mx(weight, quant_format, 32, axis=-1)
    packed = pack_mx(mx)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 96 + 96 // 32)
    back = unpack_mx(packed, MXRecipe(quant_format), weight.dtype)
    assert torch.equal(back.codes, mx.codes) and torch.equal(back.scale, mx.scale)
    assert torch.equal(back.dequantize(), mx.dequantize())


@pytest.mark.parametrize("quant_format", ["E4M3", "HIF8"])
def test_a_shard_cut_on_block_edges_is_the_packing_of_the_same_shard_of_the_weight(quant_format):
    """FSDP cuts rows and rowwise TP cuts columns at a multiple of the block: each rank's piece of the
    packed bytes must be exactly the packing of its piece of the weight, so it encodes and decodes alone."""
    recipe = MXRecipe(quant_format)
    weight = torch.randn(8, 128) * 2
    form = MXPackedRows(recipe, weight.dtype)
    packed = form.encode(weight)
    width = packed.shape[1] // 2  # the second rowwise half: columns 64:128 of the weight
    assert form.values_box((4, width), (4, width)) == ((4, 64), (4, 64))
    torch.testing.assert_close(packed[4:, width:], form.encode(weight[4:, 64:]), rtol=0, atol=0)
    torch.testing.assert_close(form.decode(packed[4:, width:], torch.float32),
                               form.decode(packed, torch.float32)[4:, 64:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="whole blocks of 33 bytes"):
        form.values_box((0, 5), (8, 33))
    # a rank FSDP gives no rows (more ranks than rows) encodes and decodes its empty box
    assert form.encode(weight[:0]).shape == (0, 132) and form.decode(packed[:0], torch.float32).shape == (0, 128)


@pytest.mark.parametrize("quant_format", ["E4M3", "HIF8"])
def test_frozen_bases_compute_exactly_with_the_reference_quantization(quant_format):
    model = _adapted_model()
    plan = QuantizeConfig(quant_format=quant_format, store_frozen_weights=True)
    reference = _adapted_model()
    with torch.no_grad():  # the reference: the same function's values, in a plain float32 Linear
        for layer in (reference[0], reference[2]):
            layer.base_layer.weight.copy_(frozen_weight_values(layer.base_layer.weight, MXRecipe.from_config(plan)))
    converted = convert_model(model, plan)
    assert converted == {"0.base_layer": "mx_frozen_linear", "2.base_layer": "mx_frozen_linear"}
    assert isinstance(model[0].base_layer, MXFrozenLinear)
    assert type(model[0].lora_A) is nn.Linear  # the trainable adapters stay high precision
    x = torch.randn(5, 64)
    outs, grads = [], []
    for m in (model, reference):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.square().sum().backward()
        outs.append(out)
        grads.append([xi.grad, m[0].lora_A.weight.grad, m[2].lora_B.weight.grad])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert model[0].base_layer.weight.grad is None


def test_frozen_storage_is_one_byte_per_element_and_one_per_block():
    model = _adapted_model()
    convert_model(model, QuantizeConfig(store_frozen_weights=True))
    weight = model[0].base_layer.weight
    assert weight.dtype == torch.uint8 and not weight.requires_grad
    bytes_ = weight.numel() * weight.element_size()
    assert bytes_ == 96 * 64 * (1 + 1 / 32)
    assert bytes_ / (96 * 64 * 2) == pytest.approx(0.515625)  # of bf16
    assert bytes_ / (96 * 64 * 4) == pytest.approx(0.2578125)  # of fp32


def test_a_trainable_picked_weight_is_a_config_error_naming_the_module():
    model = tiny_hf_causal_lm("llama")  # full fine-tuning: every weight trains
    with pytest.raises(ConfigError, match=r"store_frozen_weights=True.*model\.layers\.0\.self_attn\.q_proj\.weight "
                                          r"is trainable"):
        convert_model(model, QuantizeConfig(apply_modules=["*.q_proj"], store_frozen_weights=True))


def test_a_meta_built_frozen_weight_becomes_a_meta_packed_parameter_with_its_stored_form():
    """Quantized when a checkpoint is loaded (``load_pretrained`` encodes each rank's box through the form)."""
    with torch.device("meta"):
        meta = _adapted_model()
    convert_model(meta, QuantizeConfig(store_frozen_weights=True))
    weight = meta[0].base_layer.weight
    assert weight.is_meta and weight.dtype == torch.uint8 and weight.shape == (96, 64 + 64 // 32)
    form = meta[0].base_layer.stored_forms["weight"]
    assert form.values_dtype == torch.float32 and form.values_box((0, 0), tuple(weight.shape)) == ((0, 0), (96, 64))


def test_conflicting_options_are_config_errors():
    with pytest.raises(ConfigError, match="set store_frozen_weights"):
        convert_model(_adapted_model(), QuantizeConfig(converters=["mx_frozen_linear"]))
    with pytest.raises(ConfigError, match="in_features=96 not divisible by block_size=64"):
        convert_model(_adapted_model(), QuantizeConfig(apply_modules=["2"], block_size=64,
                                                       store_frozen_weights=True))
    with pytest.raises(ConfigError, match=r"quantization_plan\.store_frozen_weights"):
        QuantizeConfig(store_frozen_weights="yes")


def test_without_the_flag_frozen_linears_train_mx_as_before():
    model = _adapted_model()
    convert_model(model, QuantizeConfig(apply_modules=["*.base_layer"]))
    assert isinstance(model[0].base_layer, MXLinear) and model[0].base_layer.weight.dtype == torch.float32
