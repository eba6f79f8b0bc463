"""The converter framework: named converters, picked by patterns, converting modules in place."""

from fsdp_turbo.quantization.converter import builtin  # noqa: F401 - registers the built-in converters
from fsdp_turbo.quantization.converter.plan import Conversion, apply_conversions, convert_model, plan_conversion
from fsdp_turbo.quantization.converter.registry import (
    Converter,
    converter_names,
    get_converter,
    register_converter,
    unregister_converter,
)

__all__ = ["Conversion", "Converter", "apply_conversions", "convert_model", "converter_names", "get_converter",
           "plan_conversion", "register_converter", "unregister_converter"]
