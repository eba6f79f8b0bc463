"""``MXLinear``: an ``nn.Linear`` whose three GEMMs are MX-quantized; DTensor-aware for FSDP2 and TP."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.quantization.tp_linear import tp_linear
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe


class MXLinear(nn.Linear):
    """A Linear trained with MX block quantization (``mx_recipe``); parameters stay high precision.

    Made by converting an existing ``nn.Linear`` in place (:func:`to_mx_linear`), so the
    parameters, their names and ``state_dict`` keys are unchanged.
    """

    mx_recipe: MXRecipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return tp_linear(x, self.weight, self.bias, lambda xl, wl, bl: mx_linear(xl, wl, bl, self.mx_recipe))
        return mx_linear(x, self.weight, self.bias, self.mx_recipe)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return f"{super().extra_repr()}, mx={r.quant_format}/{r.block_size}/{r.scale_mode}"


def to_mx_linear(module: nn.Linear, recipe: MXRecipe) -> MXLinear:
    """Turn ``module`` into an ``MXLinear`` in place (a subclass of its own class)."""
    return mix_in(module, MXLinear, "MX", mx_recipe=recipe)
