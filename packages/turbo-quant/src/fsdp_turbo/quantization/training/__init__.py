"""Quantized training: MX linear layers (emulated, or a device kernel from the op registry)."""

from fsdp_turbo.quantization.training.fake_quant import mx_fake_quantize
from fsdp_turbo.quantization.training.mx_linear import MXLinear, to_mx_linear
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe

__all__ = ["MXLinear", "MXRecipe", "mx_fake_quantize", "mx_linear", "to_mx_linear"]
