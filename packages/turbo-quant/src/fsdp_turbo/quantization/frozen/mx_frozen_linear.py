"""``MXFrozenLinear``: a Linear whose frozen weight is stored as MX bytes (QLoRA-MX).

Storage: the weight is quantized once, blocks of ``block_size`` along ``in_features``, and kept
as one uint8 parameter of shape ``(out_features, in_features + in_features // block_size)``: each
row holds its element codes (E4M3 / E5M2 / HIF8, one byte each) followed by its blocks' E8M0
scales (one byte each). That is ``1 + 1/block_size`` bytes per element, 0.52x of bf16 and 0.26x
of fp32 at block 32.

FSDP2 shards the parameter along dim 0, so every shard holds whole rows and therefore whole
blocks (uneven row counts are padded by FSDP as for any parameter). The all-gather moves the same
bytes: FSDP2 leaves mixed precision off for a non-floating parameter
(``FSDPParam.init_dtype_attrs``), so nothing casts the bytes to ``param_dtype`` before the
collective, and no tensor subclass with ``fsdp_pre_all_gather`` is needed to keep them MX.

GEMMs: none reads MX. After the all-gather the weight is dequantized to the input's dtype for
the forward GEMM, and dequantized again from the saved bytes for the input-gradient GEMM (so the
dequantized weight is not kept between forward and backward). The weight is frozen: there is no
weight-gradient GEMM. A bias, if any, stays a high-precision parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.quantization.mx_formats.formats import get_format
from fsdp_turbo.quantization.mx_formats.mx_tensor import MXTensor, dequantize_mx, quantize_mx
from fsdp_turbo.quantization.training.recipe import MXRecipe


def quantize_frozen_weight(weight: torch.Tensor, recipe: MXRecipe) -> MXTensor:
    """The one quantization of a frozen ``(out, in)`` weight: blocks along ``in_features``.
    The single-process reference uses it too, so both sides hold the very same codes."""
    return quantize_mx(weight.detach(), recipe.quant_format, recipe.block_size, recipe.scale_mode, axis=-1,
                       emax_elem=recipe.emax_elem)


def frozen_weight_values(weight: torch.Tensor, recipe: MXRecipe, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values ``MXFrozenLinear`` computes with for ``weight`` (quantized, then dequantized)."""
    return dequantize_mx(quantize_frozen_weight(weight, recipe), dtype or weight.dtype)


def pack_mx(mx: MXTensor) -> torch.Tensor:
    """``(out, in + in // block)`` uint8: each row's element codes, then its block scales."""
    return torch.cat([mx.codes, mx.scale], dim=1).contiguous()


def unpack_mx(packed: torch.Tensor, in_features: int, recipe: MXRecipe, orig_dtype: torch.dtype) -> MXTensor:
    """The ``MXTensor`` a packed weight holds (views, no copy of the codes)."""
    codes, scale = packed.split([in_features, in_features // recipe.block_size], dim=1)
    fmt = get_format(recipe.quant_format)
    return MXTensor(data=codes.view(fmt.data_dtype), scale=scale, quant_format=fmt.name,
                    block_size=recipe.block_size, axis=1, scale_mode=recipe.scale_mode,
                    emax_elem=recipe.emax_elem if recipe.emax_elem is not None else fmt.emax_elem,
                    orig_dtype=orig_dtype, orig_shape=codes.shape)


class _FrozenMXLinearFunction(torch.autograd.Function):
    """``functional.linear`` over the dequantized packed weight; saves the packed bytes, not the values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                recipe: MXRecipe) -> torch.Tensor:
        weight = dequantize_mx(unpack_mx(packed, in_features, recipe, x.dtype), x.dtype)
        ctx.save_for_backward(packed)
        ctx.in_features, ctx.recipe, ctx.has_bias = in_features, recipe, bias is not None
        return functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (packed,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = dequantize_mx(unpack_mx(packed, ctx.in_features, ctx.recipe, grad_out.dtype), grad_out.dtype)
            grad_x = grad_out.matmul(weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None, None


class MXFrozenLinear(nn.Linear):
    """A Linear whose frozen weight is a packed MX uint8 parameter (see the module docstring).

    Made in place by :func:`to_mx_frozen_linear`; the parameter keeps its name (``weight``), its
    ``state_dict`` entry holds the packed bytes."""

    mx_recipe: MXRecipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenMXLinearFunction.apply(x, self.weight, self.bias, self.in_features, self.mx_recipe)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return f"{super().extra_repr()}, frozen weight stored {r.quant_format}/{r.block_size}/{r.scale_mode}"


def to_mx_frozen_linear(module: nn.Linear, recipe: MXRecipe) -> MXFrozenLinear:
    """Quantize ``module``'s frozen weight into its packed MX parameter, in place."""
    packed = pack_mx(quantize_frozen_weight(module.weight, recipe))
    module.weight = nn.Parameter(packed, requires_grad=False)
    return mix_in(module, MXFrozenLinear, "MXFrozen", mx_recipe=recipe)
