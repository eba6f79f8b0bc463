"""``mx.quantize`` and ``mx.linear`` on Ascend NPUs through torch_npu (imported only here).

- ``mx.quantize``: ``torch_npu.npu_dynamic_mx_quant(x, axis=..., round_mode="rint",
  dst_type=float8, block_size=32)`` (FLOOR scales, OCP MX), its paired scales unpacked to
  ``MXTensor.scale``'s layout. Only for E4M3 / E5M2, FLOOR, the format's emax, block 32 and
  bf16 / fp16 input; anything else runs the portable kernel.
- ``mx.linear``: each of the three GEMMs quantizes both operands along its contraction
  dimension (the operand's last axis, as the NPU MX GEMM wants ``[M, K] x [N, K]``) and runs
  ``torch_npu.npu_quant_matmul(a, b.t(), b_scale.transpose(0, 1), pertoken_scale=a_scale,
  scale_dtype=pertoken_scale_dtype=torch_npu.float8_e8m0fnu, group_sizes=[1, 1, 32])``, the
  call MindSpeed's MXFP8 linear makes. Unsupported recipes run the emulated GEMMs.

UNTESTED ON HARDWARE (no NPU here; the ops need an Ascend 950). The CPU tests run this module
against a stand-in torch_npu built from the portable kernels, which checks the glue (axes,
transposes, scale layouts) under the documented shapes, not the NPU's numerics: whether its
zero, tiny and non-finite blocks follow ``mx_formats``' policies is not known.
"""

from __future__ import annotations

import torch
import torch_npu

from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.ops import PORTABLE, get_op
from fsdp_turbo.quantization.ops.npu_mx_layout import (
    NPU_BLOCK,
    npu_linear_unsupported,
    npu_quantize_unsupported,
    scales_from_pairs,
)
from fsdp_turbo.quantization.training.fake_quant import pad_rows
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear_emulated
from fsdp_turbo.quantization.training.recipe import MXRecipe

__all__ = ["mx_linear_npu", "quantize_mx_npu"]

_log = get_logger(__name__)
_DST = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}


def _dynamic_mx_quant(x: torch.Tensor, quant_format: str, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_npu.npu_dynamic_mx_quant(x.contiguous(), axis=axis, round_mode="rint", dst_type=_DST[quant_format],
                                          block_size=NPU_BLOCK)


def quantize_mx_npu(
    x: torch.Tensor, quant_format: str, block_size: int, scale_mode: str, axis: int, emax_elem: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mx.quantize`` kernel for "npu" (arguments pre-validated by ``quantize_mx``)."""
    reason = npu_quantize_unsupported(quant_format, block_size, scale_mode, emax_elem, x.dtype)
    if reason is not None:
        warn_once(_log, f"mx.quantize on npu: portable kernel ({reason})")
        return get_op("mx.quantize", PORTABLE)(x, quant_format, block_size, scale_mode, axis, emax_elem)
    data, mxscale = _dynamic_mx_quant(x.detach(), quant_format, axis)
    return data.view(_DST[quant_format]), scales_from_pairs(mxscale, axis, x.shape[axis] // block_size)


def _quantize_2d(t: torch.Tensor, quant_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and paired scales of a 2-D tensor along its last axis (the NPU GEMM's layout)."""
    return _dynamic_mx_quant(t, quant_format, -1)


def _gemm(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
          dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` for ``a [M, K]``, ``b [N, K]`` quantized along K."""
    (a_data, a_scale), (b_data, b_scale) = a, b
    return torch_npu.npu_quant_matmul(a_data, b_data.t(), b_scale.transpose(0, 1), pertoken_scale=a_scale,
                                      output_dtype=dtype, scale_dtype=torch_npu.float8_e8m0fnu,
                                      pertoken_scale_dtype=torch_npu.float8_e8m0fnu,
                                      group_sizes=[1, 1, NPU_BLOCK])


class _MXLinearNPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(x2d, weight)
        ctx.recipe = recipe
        fmt = recipe.quant_format
        return _gemm(_quantize_2d(x2d, fmt), _quantize_2d(weight, fmt), x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        fmt, block = ctx.recipe.quant_format, ctx.recipe.block_size
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(_quantize_2d(grad_out, fmt), _quantize_2d(weight.t(), fmt), x2d.dtype)
        if ctx.needs_input_grad[1]:
            dy_t = _quantize_2d(pad_rows(grad_out, block).t(), fmt)
            grad_w = _gemm(dy_t, _quantize_2d(pad_rows(x2d, block).t(), fmt), x2d.dtype).to(weight.dtype)
        return grad_x, grad_w, None


def mx_linear_npu(x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    """``mx.linear`` for "npu": ``npu_quant_matmul`` where the recipe allows, else emulated."""
    reason = npu_linear_unsupported(recipe, weight.shape[1], weight.shape[0], x2d.dtype)
    if reason is not None:
        warn_once(_log, f"mx.linear on npu: emulated GEMMs ({reason})")
        return mx_linear_emulated(x2d, weight, recipe)
    return _MXLinearNPU.apply(x2d, weight, recipe)
