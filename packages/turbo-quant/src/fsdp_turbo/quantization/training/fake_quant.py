"""Quantize-dequantize along one axis: the numbers an MX GEMM sees, in a float dtype.

The emulated path multiplies these in higher precision; every MX element times its
power-of-two scale is exact in bf16 and fp32, so emulation is exact up to the matmul.

It is a ``torch.library`` custom op, so ``torch.compile`` sees one opaque node with a
known output (same shape, requested dtype) instead of tracing the quantizer's
workspaces and data-dependent NaN handling, which would break the graph in every GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.quantization.mx_formats import dequantize_mx, quantize_mx
from fsdp_turbo.quantization.training.recipe import MXRecipe


@torch.library.custom_op("fsdp_turbo::mx_fake_quantize", mutates_args=())
def _fake_quantize_op(tensor: torch.Tensor, quant_format: str, block_size: int, scale_mode: str, axis: int,
                      emax_elem: int | None, dtype: torch.dtype) -> torch.Tensor:
    mx = quantize_mx(tensor, quant_format=quant_format, block_size=block_size, scale_mode=scale_mode, axis=axis,
                     emax_elem=emax_elem)
    return dequantize_mx(mx, dtype)


@_fake_quantize_op.register_fake
def _(tensor, quant_format, block_size, scale_mode, axis, emax_elem, dtype):
    return torch.empty_like(tensor, dtype=dtype, memory_format=torch.contiguous_format)


def mx_fake_quantize(tensor: torch.Tensor, recipe: MXRecipe, *, axis: int, gradient: bool = False,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize_mx(quantize_mx(tensor, ...))`` along ``axis``. No autograd of its own:
    MX GEMMs call it inside their ``autograd.Function``."""
    return _fake_quantize_op(tensor, recipe.quant_format, recipe.block_size, recipe.scale_mode, axis,
                             recipe.emax(gradient=gradient), dtype or tensor.dtype)


def pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple of the block: zeros add nothing to a GEMM over rows."""
    extra = -tensor.shape[0] % multiple
    return F.pad(tensor, (0, 0, 0, extra)) if extra else tensor
