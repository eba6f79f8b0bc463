"""``MXLinear``: an ``nn.Linear`` whose three GEMMs are MX-quantized; DTensor-aware for FSDP2 and TP."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.core.model_inspect import local_tensor
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe


def _tp_mx_linear(x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None, recipe: MXRecipe) -> DTensor:
    """Each rank runs the MX GEMMs on its shard; the result carries the placement ``F.linear``
    would give (colwise: Shard(-1); rowwise: Partial; replicated: Replicate)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(f"MXLinear supports a 1-D tensor-parallel mesh, not {mesh}")
    placement = weight.placements[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    out_dim = x.dim() - 1
    if isinstance(placement, Shard) and placement.dim == 0:  # colwise: out features sharded
        x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        out = mx_linear(x_local, weight.to_local(), local_tensor(bias), recipe)
        return DTensor.from_local(out, mesh, [Shard(out_dim)], run_check=False)
    if isinstance(placement, Shard) and placement.dim == 1:  # rowwise: in features sharded
        x_local = x.redistribute(mesh, [Shard(out_dim)]).to_local()
        out = DTensor.from_local(mx_linear(x_local, weight.to_local(), None, recipe), mesh, [Partial()],
                                 run_check=False)
        return out if bias is None else out + bias
    x_local = x.redistribute(mesh, [Replicate()]).to_local()
    out = mx_linear(x_local, weight.to_local(), local_tensor(bias), recipe)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


class MXLinear(nn.Linear):
    """A Linear trained with MX block quantization (``mx_recipe``); parameters stay high precision.

    Made by converting an existing ``nn.Linear`` in place (:func:`to_mx_linear`), so the
    parameters, their names and ``state_dict`` keys are unchanged.
    """

    mx_recipe: MXRecipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return _tp_mx_linear(x, self.weight, self.bias, self.mx_recipe)
        return mx_linear(x, self.weight, self.bias, self.mx_recipe)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return f"{super().extra_repr()}, mx={r.quant_format}/{r.block_size}/{r.scale_mode}"


def to_mx_linear(module: nn.Linear, recipe: MXRecipe) -> MXLinear:
    """Turn ``module`` into an ``MXLinear`` in place (a subclass of its own class)."""
    return mix_in(module, MXLinear, "MX", mx_recipe=recipe)
