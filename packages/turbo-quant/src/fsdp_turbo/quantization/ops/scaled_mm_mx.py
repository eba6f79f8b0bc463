"""``mx.linear`` on CUDA: the three MX GEMMs through ``torch._scaled_mm`` with E8M0 block scales.

Where the GPU multiplies MX blocks natively (compute capability >= 10.0, cuBLAS's 1x32
``VEC32_UE8M0`` scaling), each GEMM of ``MXLinear`` runs as one ``torch._scaled_mm`` on the
codes of ``quantize_mx`` (the registered kernel: Triton when installed), every operand
quantized along that GEMM's contraction dimension as in the emulated path:

- forward ``y = x @ W.T``:  x [T, K] and W [N, K] along K;
- dgrad  ``dx = dy @ W``:   dy [T, N] and W.T [K, N] along N;
- wgrad  ``dW = dy.T @ x``: dy.T [N, T] and x.T [K, T] along the tokens (zero-padded to 32).

``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` takes ``a [M, K]`` row-major and
``b [K, N]`` column-major (the ``.t()`` of an [N, K] row-major tensor), both float8, and the
scales as ``float8_e8m0fnu`` in cuBLAS's blocked layout (:func:`to_blocked_scales`): per
operand ``ceil(rows / 128) * 128 * ceil(K / 32 / 4) * 4`` bytes, contiguous. Those facts come
from torch's meta checks for ``_scaled_mm`` (which the CPU tests run on meta tensors) and its
own MX tests; the output is bf16 as there, then cast to the input's dtype.

Everything else (other GPUs, ROCm, HIF8, block sizes other than 32, in/out features not
multiples of 32) runs the emulated GEMMs; :func:`scaled_mm_unsupported` is the pure decision.
UNTESTED ON HARDWARE: no compute-capability-10 GPU was available. The CPU tests check the
layout against an index-formula reference, the call shapes on meta tensors, and the three
GEMMs against the emulated path with a dequantize-and-multiply stand-in for ``_scaled_mm``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.quantization.mx_formats import MXTensor, quantize_mx
from fsdp_turbo.quantization.training.fake_quant import pad_rows
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear_emulated
from fsdp_turbo.quantization.training.recipe import MXRecipe

__all__ = ["MX_MIN_CAPABILITY", "block_scaled_mm", "mx_linear_cuda", "mx_linear_scaled_mm",
           "scaled_mm_unsupported", "to_blocked_scales"]

_log = get_logger(__name__)

MX_MIN_CAPABILITY = (10, 0)
MX_BLOCK = 32  # cuBLAS MX scaling is 1x32
TILE_ROWS, TILE_COLS = 128, 4  # one blocked-layout tile: 128 rows x 4 scale columns = 512 bytes
OUT_DTYPE = torch.bfloat16
SCALED_MM_FORMATS = ("E4M3", "E5M2")

# The GEMM; a module attribute so that tests can run the path on CPU with a stand-in.
GEMM: Callable[..., torch.Tensor] | None = getattr(torch, "_scaled_mm", None)


def to_blocked_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales ``[rows, k_blocks]`` (uint8 or float8_e8m0fnu) in cuBLAS's blocked layout.

    The matrix is zero-padded to whole 128 x 4 tiles; tiles are stored row-tile-major, and
    inside a tile the scale of (row r, column c) sits at byte ``(r % 32) * 16 + (r // 32) * 4
    + c``: four 32-row slices interleaved. Returns a flat contiguous float8_e8m0fnu tensor.
    """
    if scales.dim() != 2:
        raise ValueError(f"scales must be 2-D [rows, k_blocks], got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    padded = scales.view(torch.uint8)
    if (rows, cols) != (row_tiles * TILE_ROWS, col_tiles * TILE_COLS):
        padded = torch.zeros(row_tiles * TILE_ROWS, col_tiles * TILE_COLS, dtype=torch.uint8, device=scales.device)
        padded[:rows, :cols] = scales.view(torch.uint8)
    # (row tile, 32-row slice, row in slice, col tile, col) -> (row tile, col tile, row in slice, slice, col)
    tiles = padded.view(row_tiles, 4, 32, col_tiles, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(-1).view(torch.float8_e8m0fnu)


def scaled_mm_unsupported(
    *,
    quant_format: str,
    block_size: int,
    in_features: int,
    out_features: int,
    capability: tuple[int, int] | None,
    rocm: bool = False,
    has_scaled_mm: bool = True,
) -> str | None:
    """Why ``mx.linear`` cannot use ``torch._scaled_mm`` here, or None when it can (pure)."""
    if capability is None:
        return "not a CUDA device"
    if rocm:
        return "ROCm (torch._scaled_mm takes MX scales unswizzled there; this path writes cuBLAS's layout)"
    if tuple(capability) < MX_MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} < 10.0 has no MX block-scaled GEMM"
    if not has_scaled_mm:
        return "this torch has no torch._scaled_mm / float8_e8m0fnu"
    if quant_format not in SCALED_MM_FORMATS:
        return f"{quant_format} has no cuBLAS GEMM (only {', '.join(SCALED_MM_FORMATS)})"
    if block_size != MX_BLOCK:
        return f"block_size {block_size}: cuBLAS MX scaling is 1x{MX_BLOCK}"
    if in_features % MX_BLOCK or out_features % MX_BLOCK:
        return f"in/out features {in_features}/{out_features} are not multiples of {MX_BLOCK}"
    return None


def block_scaled_mm(a: MXTensor, b: MXTensor) -> torch.Tensor:
    """``a @ b.T`` for ``a [M, K]``, ``b [N, K]``, both quantized along K (their last axis)."""
    if a.axis != 1 or b.axis != 1 or a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError("block_scaled_mm takes 2-D MXTensors quantized along their last axis")
    return GEMM(a.data, b.data.t(), to_blocked_scales(a.scale), to_blocked_scales(b.scale), out_dtype=OUT_DTYPE)


def _quantize(t: torch.Tensor, recipe: MXRecipe, *, gradient: bool = False) -> MXTensor:
    return quantize_mx(t.contiguous(), recipe.quant_format, recipe.block_size, recipe.scale_mode, axis=1,
                       emax_elem=recipe.emax(gradient=gradient))


class _MXLinearScaledMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(x2d, weight)
        ctx.recipe = recipe
        return block_scaled_mm(_quantize(x2d, recipe), _quantize(weight, recipe)).to(x2d.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dy = _quantize(grad_out, recipe, gradient=True)
            grad_x = block_scaled_mm(dy, _quantize(weight.t(), recipe)).to(x2d.dtype)
        if ctx.needs_input_grad[1]:
            block = recipe.block_size
            dy_t = _quantize(pad_rows(grad_out, block).t(), recipe, gradient=True)
            grad_w = block_scaled_mm(dy_t, _quantize(pad_rows(x2d, block).t(), recipe)).to(weight.dtype)
        return grad_x, grad_w, None


def mx_linear_scaled_mm(x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    """The MX linear with its three GEMMs through :data:`GEMM` (no support check)."""
    return _MXLinearScaledMM.apply(x2d, weight, recipe)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def mx_linear_cuda(x2d: torch.Tensor, weight: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    """``mx.linear`` for CUDA: ``torch._scaled_mm`` where supported, else the emulated GEMMs."""
    reason = scaled_mm_unsupported(
        quant_format=recipe.quant_format, block_size=recipe.block_size, in_features=weight.shape[1],
        out_features=weight.shape[0], capability=_capability(x2d.device), rocm=torch.version.hip is not None,
        has_scaled_mm=GEMM is not None and hasattr(torch, "float8_e8m0fnu"))
    if reason is not None:
        warn_once(_log, f"mx.linear: emulated GEMMs on {x2d.device.type} ({reason})")
        return mx_linear_emulated(x2d, weight, recipe)
    return mx_linear_scaled_mm(x2d, weight, recipe)
