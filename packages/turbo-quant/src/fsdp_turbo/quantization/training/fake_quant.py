"""Quantize-dequantize along one axis: the numbers an MX GEMM sees, in a float dtype.

The emulated path multiplies these in higher precision; every MX element times its
power-of-two scale is exact in bf16 and fp32, so emulation is exact up to the matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.quantization.mx_formats import dequantize_mx, quantize_mx
from fsdp_turbo.quantization.training.recipe import MXRecipe


def mx_fake_quantize(tensor: torch.Tensor, recipe: MXRecipe, *, axis: int, gradient: bool = False,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    mx = quantize_mx(tensor, quant_format=recipe.quant_format, block_size=recipe.block_size,
                     scale_mode=recipe.scale_mode, axis=axis, emax_elem=recipe.emax(gradient=gradient))
    return dequantize_mx(mx, dtype or tensor.dtype)


def pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple of the block: zeros add nothing to a GEMM over rows."""
    extra = -tensor.shape[0] % multiple
    return F.pad(tensor, (0, 0, 0, extra)) if extra else tensor
