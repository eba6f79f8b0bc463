"""MX block quantization: ``quantize_mx`` / ``dequantize_mx`` and the ``MXTensor`` they exchange.

A block is ``block_size`` consecutive elements along ``axis``. Each block gets one
E8M0 scale ``2**s`` (see ``e8m0`` for FLOOR / RCEIL and the zero, tiny and
Inf/NaN policies), and each element the code of ``clamp(x / 2**s, +-max_elem)``:
round-to-nearest-even for E4M3 / E5M2, round-half-away-from-zero for HIF8.
Elements of a block whose scale is NaN (it held an Inf or a NaN) all get the
format's NaN code (0x7F for E4M3 / E5M2, 0x80 for HIF8), and dequantize to NaN.

The portable kernels are registered in turbo-core's op registry as ``mx.quantize``
and ``mx.dequantize`` (``hif8.encode`` / ``hif8.decode`` live in ``hif8``); device
kernels register under the same names and receive already-validated arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.fsdp_turbo_config import SCALE_MODES
from fsdp_turbo.quantization.mx_formats._common import Workspace, as_float32, check_floating, row_chunks
from fsdp_turbo.quantization.mx_formats.e8m0 import (
    E8M0_NAN,
    block_scale_exponents,
    e8m0_to_float32,
    pow2_float32,
    pow2_float64,
)
from fsdp_turbo.quantization.mx_formats.formats import FORMATS, MXFormat, get_format
from fsdp_turbo.quantization.mx_formats.fp8 import fp8_encode_into
from fsdp_turbo.quantization.mx_formats.hif8 import hif8_decode_into, hif8_encode_into

__all__ = ["MXTensor", "block_view", "dequantize_mx", "quantize_mx", "scale_shape"]


@dataclass(frozen=True, eq=False)
class MXTensor:
    """Block-quantized tensor: element codes, one E8M0 scale per block, and how they were made.

    ``data`` has ``orig_shape``: float8_e4m3fn / float8_e5m2 for the FP8 formats,
    uint8 for HIF8; ``data.view(torch.uint8)`` (``codes``) gives the bytes either way.
    ``scale`` is uint8 E8M0, shaped like ``orig_shape`` with ``orig_shape[axis] //
    block_size`` along ``axis``. ``axis`` is stored non-negative; ``emax_elem`` is the
    value used (the format default when none was given).
    """

    data: torch.Tensor
    scale: torch.Tensor
    quant_format: str
    block_size: int
    axis: int
    scale_mode: str
    emax_elem: int
    orig_dtype: torch.dtype
    orig_shape: torch.Size

    @property
    def codes(self) -> torch.Tensor:
        """The element codes as uint8."""
        return self.data.view(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mx(self, dtype)


def block_view(shape: torch.Size, axis: int, block_size: int) -> tuple[int, int]:
    """(rows, post): a tensor of ``shape`` viewed as (rows, block_size, post), one block per (row, post)."""
    pre, post = math.prod(shape[:axis]), math.prod(shape[axis + 1 :])
    return pre * (shape[axis] // block_size), post


def scale_shape(shape: torch.Size, axis: int, block_size: int) -> tuple[int, ...]:
    return (*shape[:axis], shape[axis] // block_size, *shape[axis + 1 :])


@register_op("mx.quantize")
def _quantize_mx_portable(
    x: torch.Tensor, quant_format: str, block_size: int, scale_mode: str, axis: int, emax_elem: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable kernel: (element codes shaped like ``x``, uint8 scales). Arguments pre-validated."""
    fmt = FORMATS[quant_format]
    rows, post = block_view(x.shape, axis, block_size)
    # Viewing (rows, block, post) keeps x's layout for any axis: no transpose.
    x3 = x.detach().contiguous().view(rows, block_size, post)
    data = torch.empty(x3.shape, dtype=fmt.data_dtype, device=x.device)
    scale = torch.empty((rows, post), dtype=torch.uint8, device=x.device)
    target = fmt.rceil_target(emax_elem)
    work = Workspace(rows, block_size * post, x.device)
    for chunk in row_chunks(rows, block_size * post):
        _quantize_rows(x3[chunk], data[chunk], scale[chunk], work, fmt, scale_mode, emax_elem, target)
    return data.view(x.shape), scale.view(scale_shape(x.shape, axis, block_size))


def _quantize_rows(
    x3: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    work: Workspace,
    fmt: MXFormat,
    scale_mode: str,
    emax_elem: int,
    target: float,
) -> None:
    if x3.dtype == torch.float64:
        # Scale in float64 first, so that the fp32 narrowing only ever sees in-range values.
        abs_bits = x3.view(torch.int64) & 0x7FFFFFFFFFFFFFFF
        s, codes = block_scale_exponents(abs_bits.amax(dim=1), scale_mode, emax_elem, target)
        scaled64 = (x3 * pow2_float64(-s).unsqueeze(1)).clamp_(-fmt.max_elem, fmt.max_elem)
        scaled = work.f32(x3.shape).copy_(as_float32(scaled64))
    else:
        xf = work.load_f32(x3)
        # |x| as int32 bits: the integer max equals the float amax, keeps NaN (its bits sort
        # above Inf's) and hands the scale code its exponent and mantissa fields directly.
        abs_bits = torch.bitwise_and(xf.view(torch.int32), 0x7FFFFFFF, out=work.i32(x3.shape))
        s, codes = block_scale_exponents(abs_bits.amax(dim=1), scale_mode, emax_elem, target)
        # x * 2**-s is exact (a power of two; results too small for fp32 normals are far
        # below every format's smallest code). It reuses the |x| buffer.
        scaled = torch.mul(xf, pow2_float32(-s).unsqueeze(1), out=abs_bits.view(torch.float32))
    if fmt.data_dtype == torch.uint8:  # HIF8
        scaled.clamp_(-fmt.max_elem, fmt.max_elem)
        hif8_encode_into(scaled, data)
    else:
        fp8_encode_into(scaled, data, fmt)
    # Inf/NaN policy: the whole block is NaN (scale 0xFF, every element the NaN code).
    nan_blocks = codes == E8M0_NAN
    if bool(nan_blocks.any()):
        data.view(torch.uint8).masked_fill_(nan_blocks.unsqueeze(1), fmt.nan_code)
    scale.copy_(codes)


@register_op("mx.dequantize")
def _dequantize_mx_portable(
    data: torch.Tensor, scale: torch.Tensor, quant_format: str, block_size: int, axis: int, dtype: torch.dtype
) -> torch.Tensor:
    """Portable kernel: ``decode(data) * 2**scale`` in ``dtype``. Arguments pre-validated."""
    fmt = FORMATS[quant_format]
    rows, post = block_view(data.shape, axis, block_size)
    codes = data.view(torch.uint8).reshape(rows, block_size, post)
    scales = scale.view(torch.uint8).reshape(rows, post)
    out = torch.empty((rows, block_size, post), dtype=dtype, device=data.device)
    work = Workspace(rows, block_size * post, data.device)
    for chunk in row_chunks(rows, block_size * post):
        c = codes[chunk]
        values = work.f32(c.shape)
        if fmt.data_dtype == torch.uint8:
            hif8_decode_into(c, values, work.i32(c.shape))
        else:
            values.copy_(c.view(fmt.data_dtype))
        factor = e8m0_to_float32(scales[chunk]).unsqueeze(1)
        if dtype == torch.float32:
            torch.mul(values, factor, out=out[chunk])
        elif dtype == torch.float64:  # exact even where the fp32 product would over/underflow
            out[chunk].copy_(values).mul_(factor.double())
        else:  # one rounding, of the exact fp32 product
            out[chunk].copy_(values.mul_(factor))
    return out.view(data.shape)


def _check_mode(scale_mode: object) -> str:
    mode = scale_mode.strip().lower() if isinstance(scale_mode, str) else None
    if mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; expected one of {list(SCALE_MODES)}")
    return mode


def _check_axis(axis: object, ndim: int) -> int:
    if ndim == 0:
        raise ValueError("cannot block-quantize a 0-dim tensor: it has no axis to block along")
    if not isinstance(axis, int) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis!r} is out of range for a {ndim}-dim tensor")
    return axis % ndim


def _check_block_size(block_size: object, shape: torch.Size, axis: int) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if shape[axis] % block_size:
        raise ValueError(
            f"block_size {block_size} does not divide the length {shape[axis]} of axis {axis} "
            f"(shape {tuple(shape)}); pad that axis or pick a block size that divides it"
        )
    return block_size


def _check_emax(emax_elem: object, fmt: MXFormat) -> int:
    if emax_elem is None:
        return fmt.emax_elem
    if not isinstance(emax_elem, int) or isinstance(emax_elem, bool) or not 0 <= emax_elem <= fmt.max_exponent:
        raise ValueError(f"emax_elem for {fmt.name} must be an int in [0, {fmt.max_exponent}], got {emax_elem!r}")
    return emax_elem


def quantize_mx(
    x: torch.Tensor,
    quant_format: str = "E4M3",
    block_size: int = 32,
    scale_mode: str = "floor",
    axis: int = -1,
    emax_elem: int | None = None,
) -> MXTensor:
    """Block-quantize floating ``x`` to an MX format ('E4M3', 'E5M2' or 'HIF8').

    ``scale_mode`` 'floor' (OCP MX: ``s = floor(log2(amax)) - emax_elem``) or 'rceil'
    (NVIDIA MXFP8: ``s = ceil(log2(amax / target))``, target = the largest element
    below ``2**(emax_elem + 1)``: 448, 57344, 15 for HIF8's default). ``emax_elem``
    defaults to 8 / 15 / 3; HIF8 uses 3 so block maxima land in its 3-mantissa-bit
    region, e.g. 7 for gradients (RCEIL target 224). Scaled elements are clamped to
    +-max_elem (448, 57344, 2**15) before rounding, so nothing overflows to Inf.

    Policies, identical in both modes: an all-zero block, or one whose amax is below
    2**-126, gets the minimum scale 2**-127 (byte 0x00); a block holding Inf or NaN gets
    scale 0xFF (NaN) and the NaN code in every element; other exponents are clamped to
    [-127, 127]. float64 input is scaled in float64, so it rounds exactly too.

    Raises ValueError for an unknown format or mode, a non-floating ``x``, a 0-dim
    ``x``, a bad axis or ``emax_elem``, or a ``block_size`` that does not divide
    ``x.shape[axis]``.
    """
    check_floating(x)
    fmt = get_format(quant_format)
    mode = _check_mode(scale_mode)
    axis = _check_axis(axis, x.dim())
    block_size = _check_block_size(block_size, x.shape, axis)
    emax = _check_emax(emax_elem, fmt)
    data, scale = call_op("mx.quantize", x.device.type, x, fmt.name, block_size, mode, axis, emax)
    return MXTensor(
        data=data,
        scale=scale,
        quant_format=fmt.name,
        block_size=block_size,
        axis=axis,
        scale_mode=mode,
        emax_elem=emax,
        orig_dtype=x.dtype,
        orig_shape=x.shape,
    )


def dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``mx`` in ``dtype`` (a floating dtype): element value times its block's scale."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"dequantize_mx takes an MXTensor, got {type(mx).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = mx.data.device.type
    return call_op("mx.dequantize", device, mx.data, mx.scale, mx.quant_format, mx.block_size, mx.axis, dtype)
