"""The MX linear GEMMs, each quantized along its own contraction dimension.

- forward  y  = x @ W.T    : x and W along K (in features);
- dgrad    dx = dy @ W     : dy and W along N (out features);
- wgrad    dW = dy.T @ x   : dy and x along the tokens (padded to the block with zeros).

The high-precision x and W are saved and re-quantized along the other axes in backward,
as each GEMM needs its own blocks. The matmuls run in fp32 (the emulated path); a device
kernel registered as ``mx.linear`` in the op registry replaces the whole function.
"""

from __future__ import annotations

import torch

from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.quantization.training.fake_quant import mx_fake_quantize, pad_rows
from fsdp_turbo.quantization.training.mx_gather import mx_weight
from fsdp_turbo.quantization.training.recipe import MXRecipe


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.float(), b.float())


class _MXLinearEmulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(x2d, weight)
        ctx.recipe = recipe
        xq = mx_fake_quantize(x2d, recipe, axis=1)
        wq = mx_weight(weight, recipe, axis=1, backward=False)
        return _mm(xq, wq.t()).to(x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = mx_fake_quantize(grad_out, recipe, axis=1, gradient=True)
            wq = mx_weight(weight, recipe, axis=0, backward=True)
            grad_x = _mm(gq, wq).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            block = recipe.block_size
            gq = mx_fake_quantize(pad_rows(grad_out, block), recipe, axis=0, gradient=True)
            xq = mx_fake_quantize(pad_rows(x2d, block), recipe, axis=0)
            grad_w = _mm(gq.t(), xq).to(weight.dtype)
        return grad_x, grad_w, None


@register_op("mx.linear")
def mx_linear_emulated(x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    return _MXLinearEmulated.apply(x2d, weight, recipe)


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: MXRecipe) -> torch.Tensor:
    """``F.linear`` with MX-quantized GEMMs (plain tensors; see ``mx_linear_module`` for DTensors)."""
    x2d = x.reshape(-1, x.shape[-1])
    out = call_op("mx.linear", x.device.type, x2d, weight, recipe)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
