"""What the NPU backend can do, and its scale layout: pure functions, importable without torch_npu.

``torch_npu.npu_dynamic_mx_quant`` (Ascend 950; CANN op DynamicMxQuant) returns its E8M0
scales in pairs: ``rank(mxscale) = rank(x) + 1``, ``mxscale.shape[axis] = ceil(ceil(n / 32) /
2)``, ``mxscale.shape[-1] = 2`` (CANN ops-nn's DynamicMxQuant README). Blocks ``2i`` and
``2i + 1`` of the axis are read here as ``[..., i, ..., 0]`` and ``[..., i, ..., 1]``; that
order is an assumption, untested on hardware.
"""

from __future__ import annotations

import torch

from fsdp_turbo.quantization.mx_formats.formats import get_format
from fsdp_turbo.quantization.training.recipe import MXRecipe

__all__ = ["NPU_BLOCK", "NPU_FORMATS", "npu_linear_unsupported", "npu_quantize_unsupported", "scales_from_pairs",
           "scales_to_pairs"]

NPU_BLOCK = 32
NPU_FORMATS = ("E4M3", "E5M2")
NPU_INPUT_DTYPES = (torch.bfloat16, torch.float16)


def npu_quantize_unsupported(quant_format: str, block_size: int, scale_mode: str, emax_elem: int | None,
                             dtype: torch.dtype) -> str | None:
    """Why ``npu_dynamic_mx_quant`` cannot stand in for ``mx.quantize`` here, or None (pure)."""
    if quant_format not in NPU_FORMATS:
        return f"{quant_format}: torch_npu has no MX-block op for it"
    if scale_mode != "floor":
        return f"scale_mode {scale_mode!r}: the NPU op's default scale algorithm is FLOOR (OCP MX)"
    if emax_elem is not None and emax_elem != get_format(quant_format).emax_elem:
        return f"emax_elem {emax_elem}: the NPU op uses the format's own emax"
    if block_size != NPU_BLOCK:
        return f"block_size {block_size}: the NPU MX GEMM takes blocks of {NPU_BLOCK}"
    if dtype not in NPU_INPUT_DTYPES:
        return f"input dtype {dtype}: the NPU op takes float16 / bfloat16"
    return None


def npu_linear_unsupported(recipe: MXRecipe, in_features: int, out_features: int,
                           dtype: torch.dtype) -> str | None:
    """Why ``mx.linear`` cannot run on ``npu_quant_matmul`` here, or None (pure)."""
    for emax in (recipe.emax(gradient=False), recipe.emax(gradient=True)):
        reason = npu_quantize_unsupported(recipe.quant_format, recipe.block_size, recipe.scale_mode, emax, dtype)
        if reason is not None:
            return reason
    if in_features % NPU_BLOCK or out_features % NPU_BLOCK:
        return f"in/out features {in_features}/{out_features} are not multiples of {NPU_BLOCK}"
    return None


def scales_from_pairs(mxscale: torch.Tensor, axis: int, blocks: int) -> torch.Tensor:
    """The NPU's paired scales as ``MXTensor.scale`` (uint8, ``blocks`` along ``axis``)."""
    axis = axis % (mxscale.dim() - 1)
    flat = mxscale.movedim(-1, axis + 1).flatten(axis, axis + 1)
    return flat.narrow(axis, 0, blocks).contiguous().view(torch.uint8)


def scales_to_pairs(scale: torch.Tensor, axis: int) -> torch.Tensor:
    """``MXTensor.scale`` in the NPU's paired layout (an odd count is padded with 0x00)."""
    axis = axis % scale.dim()
    scale = scale.view(torch.uint8)
    if scale.shape[axis] % 2:
        pad = list(scale.shape)
        pad[axis] = 1
        scale = torch.cat([scale, scale.new_zeros(pad)], dim=axis)
    shape = (*scale.shape[:axis], scale.shape[axis] // 2, 2, *scale.shape[axis + 1 :])
    return scale.reshape(shape).movedim(axis + 1, -1).contiguous()
