"""Converting a module in place by mixing an MX class into its own class.

The module keeps its parameters, names and ``state_dict`` keys, and any later wrapper
(FSDP2 also swaps the class) subclasses the result.
"""

from __future__ import annotations

from torch import nn

from fsdp_turbo.quantization.training.recipe import MXRecipe

_mixed: dict[tuple[type, type], type] = {}


def mix_in(module: nn.Module, mixin: type, recipe: MXRecipe) -> nn.Module:
    base = type(module)
    if issubclass(base, mixin):
        raise ValueError(f"{base.__name__} is already {mixin.__name__}")
    if not issubclass(mixin, base):  # MXLinear already is an nn.Linear
        mixin = _mixed.setdefault((mixin, base), type(f"MX{base.__name__}", (mixin, base), {}))
    module.__class__ = mixin
    module.mx_recipe = recipe
    return module
