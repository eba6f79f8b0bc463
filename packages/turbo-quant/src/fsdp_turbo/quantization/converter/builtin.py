"""The built-in converters."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.quantization.converter.registry import Converter, register_converter
from fsdp_turbo.quantization.frozen.mx_frozen_experts import (
    EXPERT_WEIGHTS,
    MXFrozenExperts,
    frozen_experts_unsupported,
    to_mx_frozen_experts,
)
from fsdp_turbo.quantization.frozen.mx_frozen_linear import MXFrozenLinear, to_mx_frozen_linear
from fsdp_turbo.quantization.training.mx_experts import (
    MXFusedExperts,
    experts_unsupported,
    is_fused_experts,
    to_mx_experts,
)
from fsdp_turbo.quantization.training.mx_linear import MXLinear, to_mx_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe


def _own_forward(module: nn.Linear) -> str | None:
    # A Linear subclass with a forward of its own computes something else with its weight (DeepSeek-V4's
    # grouped output projection: one GEMM per group): an MX linear in its place would be wrong.
    overridden = type(module).forward is not nn.Linear.forward
    return f"{type(module).__name__} computes its own forward, not a Linear's" if overridden else None


def _linear_unsupported(module: nn.Linear, recipe: MXRecipe) -> str | None:
    # forward blocks run along in_features, dgrad blocks along out_features.
    bad = [f"{n}={v}" for n, v in (("in_features", module.in_features), ("out_features", module.out_features))
           if v % recipe.block_size]
    return _own_forward(module) or (f"{', '.join(bad)} not divisible by block_size={recipe.block_size}" if bad
                                    else None)


MX_LINEAR = register_converter(Converter(
    name="mx_linear",
    handles=lambda m: isinstance(m, nn.Linear) and not isinstance(m, MXLinear),
    unsupported=_linear_unsupported,
    convert=lambda m, recipe: to_mx_linear(m, recipe),
))


MX_EXPERTS = register_converter(Converter(
    name="mx_experts",
    handles=lambda m: is_fused_experts(m) and not isinstance(m, MXFusedExperts),
    unsupported=experts_unsupported,
    convert=lambda m, recipe: to_mx_experts(m, recipe),
))


def _frozen_linear_unsupported(module: nn.Linear, recipe: MXRecipe) -> str | None:
    # the only blocks run along in_features (no gradient of the weight, so no blocks along out_features)
    return _own_forward(module) or (f"in_features={module.in_features} not divisible by "
                                    f"block_size={recipe.block_size}" if module.in_features % recipe.block_size
                                    else None)


def _is_frozen_linear(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and not isinstance(module, (MXLinear, MXFrozenLinear))
            and not module.weight.requires_grad)


# Picked for frozen Linears when quantization_plan.store_frozen_weights is set (see plan.py);
# registered after mx_linear, so without that flag mx_linear handles every Linear as before.
MX_FROZEN_LINEAR = register_converter(Converter(
    name="mx_frozen_linear",
    handles=_is_frozen_linear,
    unsupported=_frozen_linear_unsupported,
    convert=lambda m, recipe: to_mx_frozen_linear(m, recipe),
))


def _is_frozen_experts(module: nn.Module) -> bool:
    return (is_fused_experts(module) and not isinstance(module, (MXFusedExperts, MXFrozenExperts))
            and not any(getattr(module, name).requires_grad for name in EXPERT_WEIGHTS))


# Picked for frozen fused experts when quantization_plan.store_frozen_weights is set (see plan.py);
# registered after mx_experts, so without that flag mx_experts handles every fused experts module as before.
MX_FROZEN_EXPERTS = register_converter(Converter(
    name="mx_frozen_experts",
    handles=_is_frozen_experts,
    unsupported=frozen_experts_unsupported,
    convert=lambda m, recipe: to_mx_frozen_experts(m, recipe),
))
