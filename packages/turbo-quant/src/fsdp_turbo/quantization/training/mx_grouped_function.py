"""MX grouped GEMMs for MoE experts: ``y[g] = x[g] @ W[e].T`` over expert-major token groups.

Every group starts at a multiple of the block size (zero rows pad it), so wgrad's blocks
along the tokens never straddle two experts. Each GEMM quantizes along its own contraction
dimension, as in ``mx_linear_function``; the fp32 GEMMs run as one ``torch._grouped_mm``
where torch has it, else as a loop over the groups. The whole function is the op
``mx.grouped_linear``, so a device kernel can replace it.
"""

from __future__ import annotations

import torch

from fsdp_turbo.core.grouped_mm import grouped_mm as core_grouped_mm
from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.quantization.training.fake_quant import mx_fake_quantize
from fsdp_turbo.quantization.training.mx_gather import mx_weight
from fsdp_turbo.quantization.training.recipe import MXRecipe


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """turbo-core's grouped GEMM, in fp32 (the emulated MX GEMMs run on dequantized values)."""
    return core_grouped_mm(a.float(), b.float(), offsets)


class _MXGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: MXRecipe):
        ctx.save_for_backward(x, weight, offsets)
        ctx.recipe = recipe
        xq = mx_fake_quantize(x, recipe, axis=1)
        wq = mx_weight(weight, recipe, axis=2, backward=False)
        return grouped_mm(xq, wq.transpose(1, 2), offsets).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = mx_fake_quantize(grad_out, recipe, axis=1, gradient=True)
            grad_x = grouped_mm(gq, mx_weight(weight, recipe, axis=1, backward=True), offsets).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gq = mx_fake_quantize(grad_out, recipe, axis=0, gradient=True)
            xq = mx_fake_quantize(x, recipe, axis=0)
            grad_w = grouped_mm(gq.t(), xq, offsets).to(weight.dtype)
        return grad_x, grad_w, None, None


@register_op("mx.grouped_linear")
def mx_grouped_linear_emulated(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                               recipe: MXRecipe) -> torch.Tensor:
    return _MXGroupedLinear.apply(x, weight, offsets, recipe)


def mx_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    """``x [M, K]`` in expert-major groups ending at ``offsets`` (each a multiple of the block),
    ``weight [E, N, K]`` -> ``[M, N]``, with MX-quantized forward, dgrad and wgrad GEMMs."""
    if x.shape[0] % recipe.block_size:
        raise ValueError(f"grouped rows ({x.shape[0]}) must be padded to block_size={recipe.block_size}")
    return call_op("mx.grouped_linear", x.device.type, x, weight, offsets, recipe)
