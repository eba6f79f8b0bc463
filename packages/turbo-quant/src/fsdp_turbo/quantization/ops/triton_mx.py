"""Triton kernels for ``mx.quantize`` and ``hif8.encode`` on CUDA, bit-exact with the portable ones.

``mx.quantize`` sees ``x`` as ``(rows, block, post)`` like the portable kernel (one block per
(row, post), no transpose for any axis). Each program loads a ``[ROWS_T, BLOCK_P2, POST_T]``
tile straight from bf16 / fp16 / fp32 memory and, per block, does what ``mx_formats`` does:

- amax as the integer max of ``|x|``'s fp32 bits (NaN sorts above Inf, so it is kept);
- the E8M0 exponent from those bits: FLOOR ``e - emax_elem``, RCEIL ``e - e_t + (m > m_t)``;
  amax < 2**-126 gives the minimum scale (0x00), Inf / NaN gives 0xFF, the rest is clamped
  to [-127, 127];
- ``x * 2**-s`` by exponent arithmetic on the bits, clamped to +-max_elem, then encoded with
  integer ops (FP8: round to nearest even, subnormals included; HIF8: the portable 8192-entry
  table). Floats are only ever converted exactly, so no float8 cast, flush-to-zero mode or FMA
  contraction can change a code (bf16 is even widened by a shift: Triton's interpreter
  converts bf16 subnormals wrongly);
- every element of a 0xFF block gets the format's NaN code.

float64 and other input dtypes go to the portable kernel. ``tests/test_quant_triton.py`` checks
the kernels bit for bit against the portable ones on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``) and compiles them for sm_90 / sm_100 (no ``.ftz``, no ``fma`` in the
PTX). They have not run on a GPU here: the tile size (``TILE_ELEMS``) is untuned, and
bit-exactness on a GPU is ``tools/gpu_check``'s check.
"""

# ruff: noqa: N803 - Triton's convention: compile-time (tl.constexpr) arguments are in capitals

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fsdp_turbo.core.ops import PORTABLE, get_op
from fsdp_turbo.quantization.mx_formats.formats import FORMATS, MXFormat
from fsdp_turbo.quantization.mx_formats.hif8 import HIF8_NAN, hif8_encode_table
from fsdp_turbo.quantization.mx_formats.mx_tensor import block_view, scale_shape

__all__ = ["hif8_encode_triton", "quantize_mx_triton"]

TILE_ELEMS = 4096  # elements per program: 32 per thread at 4 warps
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_LAYOUT = {"E4M3": (3, 7), "E5M2": (2, 15)}  # (mantissa bits, exponent bias)


@triton.jit
def _fp8_codes(bits, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """RNE FP8 codes (int32) of fp32 bit patterns already clamped to the format's range."""
    mag = bits & 0x7FFFFFFF
    sign = ((bits ^ mag) >> 24) & 0x80
    # Normal range: round the fp32 mantissa to MBITS bits (ties to even), then rebias.
    shift: tl.constexpr = 23 - MBITS
    lsb = (mag >> shift) & 1
    normal = ((mag + ((1 << (shift - 1)) - 1) + lsb) >> shift) - ((127 - BIAS) << MBITS)
    # Subnormal range: the 24-bit significand shifted down to units of 2**(1 - BIAS - MBITS),
    # ties to even; a carry to 1 << MBITS is the smallest normal's code, as it should be.
    # The shift stays in [1, 25]: 25 already gives 0 (full < 2**24); below 1 is the normal range.
    full = (mag & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum((24 - BIAS - MBITS) - ((mag >> 23) - 127), 1), 25)
    q = full >> sh
    rem = full & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    min_normal_bits: tl.constexpr = (128 - BIAS) << 23
    return sign | tl.where(mag >= min_normal_bits, normal, sub)


@triton.jit
def _load_fp32_bits(ptr, offsets, mask, BF16: tl.constexpr):
    """fp32 bit patterns (int32) of the input: bf16 arrives as int16 bits and is widened by a
    shift (exact for subnormals too, where a float conversion may flush them)."""
    if BF16:
        return tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def _scale_bits(bits, s):
    """Bits of ``x * 2**-s`` (s in [-127, 127]) by exponent arithmetic: exact, except that
    results below 2**-126 become a zero of the same sign (every format rounds them to +-0)."""
    mag = bits & 0x7FFFFFFF
    sign = bits ^ mag
    exponent = mag >> 23
    mant = mag & 0x7FFFFF
    shifted = exponent - s
    normal = tl.where(shifted >= 1, (shifted << 23) | mant, 0)
    # fp32 subnormal x: mant * 2**(-149 - s), an exact product of normal floats when >= 2**-126.
    sub_exp = -149 - s
    sub = (mant.to(tl.float32) * ((tl.maximum(sub_exp, -126) + 127) << 23).to(tl.float32, bitcast=True))
    sub = tl.where(sub_exp >= -126, sub.to(tl.int32, bitcast=True), 0)
    return sign | tl.where(exponent == 0, sub, normal)


@triton.jit
def _mx_quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, table_ptr, rows, post,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS_T: tl.constexpr, POST_T: tl.constexpr, BF16: tl.constexpr,
    FLOOR: tl.constexpr, EMAX: tl.constexpr, T_EXP: tl.constexpr, T_MAN: tl.constexpr,
    HIF8: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS_T + tl.arange(0, ROWS_T)
    p = tl.program_id(1).to(tl.int64) * POST_T + tl.arange(0, POST_T)
    j = tl.arange(0, BLOCK_P2)
    r3, j3, p3 = r[:, None, None], j[None, :, None], p[None, None, :]
    mask = (r3 < rows) & (j3 < BLOCK) & (p3 < post)
    offsets = (r3 * BLOCK + j3) * post + p3
    bits = _load_fp32_bits(x_ptr, offsets, mask, BF16)

    # Block scale from the bits of amax (padding lanes are 0 and never win the max).
    amax_bits = tl.max(bits & 0x7FFFFFFF, axis=1)
    biased = amax_bits >> 23
    exponent = biased - 127
    if FLOOR:  # noqa: SIM108 - a constexpr branch: only one side is compiled
        s = exponent - EMAX
    else:
        s = exponent - T_EXP + ((amax_bits & 0x7FFFFF) > T_MAN).to(tl.int32)
    s = tl.where(exponent < -126, -127, s)
    s = tl.minimum(tl.maximum(s, -127), 127)
    nonfinite = biased == 0xFF
    scale_code = tl.where(nonfinite, 0xFF, s + 127)

    scaled = _scale_bits(bits, s[:, None, :])
    mag = scaled & 0x7FFFFFFF
    scaled = (scaled ^ mag) | tl.minimum(mag, MAX_BITS)  # clamp to +-max_elem (finite blocks)
    if HIF8:
        codes = tl.load(table_ptr + ((scaled >> 19) & 0x1FFF), mask=mask, other=0).to(tl.int32)
    else:
        codes = _fp8_codes(scaled, MBITS, BIAS)
    codes = tl.where(nonfinite[:, None, :], NAN_CODE, codes)
    tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=mask)

    r2, p2 = r[:, None], p[None, :]
    tl.store(scale_ptr + r2 * post + p2, scale_code.to(tl.uint8), mask=(r2 < rows) & (p2 < post))


@triton.jit
def _hif8_encode_kernel(x_ptr, codes_ptr, table_ptr, n, TILE: tl.constexpr, BF16: tl.constexpr,
                        NAN_CODE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offsets < n
    bits = _load_fp32_bits(x_ptr, offsets, mask, BF16)
    codes = tl.load(table_ptr + ((bits >> 19) & 0x1FFF), mask=mask, other=0).to(tl.int32)
    codes = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, NAN_CODE, codes)
    tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_shape(block_size: int, post: int) -> tuple[int, int, int]:
    """(ROWS_T, BLOCK_P2, POST_T): about ``TILE_ELEMS`` per program, contiguous along ``post``."""
    block_p2 = _next_pow2(block_size)
    post_t = min(_next_pow2(post), max(1, TILE_ELEMS // block_p2))
    rows_t = max(1, TILE_ELEMS // (block_p2 * post_t))
    return rows_t, block_p2, post_t


def _bits32(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def _fields32(value: float) -> tuple[int, int]:
    bits = _bits32(value)
    return (bits >> 23) - 127, bits & 0x7FFFFF


def _format_constants(fmt: MXFormat, scale_mode: str, emax_elem: int) -> dict[str, object]:
    t_exp, t_man = _fields32(fmt.rceil_target(emax_elem))
    mbits, bias = _FP8_LAYOUT.get(fmt.name, (0, 0))
    return {"FLOOR": scale_mode == "floor", "EMAX": emax_elem, "T_EXP": t_exp, "T_MAN": t_man,
            "HIF8": fmt.data_dtype == torch.uint8, "MBITS": mbits, "BIAS": bias,
            "MAX_BITS": _bits32(fmt.max_elem), "NAN_CODE": fmt.nan_code}


def _as_kernel_input(x: torch.Tensor) -> torch.Tensor:
    # bf16 goes in as its int16 bits (see _load_fp32_bits).
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def quantize_mx_triton(
    x: torch.Tensor, quant_format: str, block_size: int, scale_mode: str, axis: int, emax_elem: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mx.quantize`` kernel: (codes shaped like ``x`` in the format's data dtype, uint8 scales)."""
    if x.dtype not in _INPUT_DTYPES:
        return get_op("mx.quantize", PORTABLE)(x, quant_format, block_size, scale_mode, axis, emax_elem)
    fmt = FORMATS[quant_format]
    rows, post = block_view(x.shape, axis, block_size)
    x = x.detach().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(scale_shape(x.shape, axis, block_size), dtype=torch.uint8, device=x.device)
    if x.numel():
        rows_t, block_p2, post_t = tile_shape(block_size, post)
        grid = (triton.cdiv(rows, rows_t), triton.cdiv(post, post_t))
        table = hif8_encode_table(x.device)
        _mx_quantize_kernel[grid](_as_kernel_input(x), codes, scale, table, rows, post, BLOCK=block_size,
                                  BLOCK_P2=block_p2, ROWS_T=rows_t, POST_T=post_t, BF16=x.dtype == torch.bfloat16,
                                  **_format_constants(fmt, scale_mode, emax_elem))
    return codes.view(fmt.data_dtype), scale


def hif8_encode_triton(x: torch.Tensor) -> torch.Tensor:
    """``hif8.encode`` kernel: HiF8 codes (uint8) of bf16 / fp16 / fp32 ``x``; float64 goes portable."""
    if x.dtype not in _INPUT_DTYPES:
        return get_op("hif8.encode", PORTABLE)(x)
    x = x.detach().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        grid = (triton.cdiv(x.numel(), TILE_ELEMS),)
        _hif8_encode_kernel[grid](_as_kernel_input(x), codes, hif8_encode_table(x.device), x.numel(),
                                  TILE=TILE_ELEMS, BF16=x.dtype == torch.bfloat16, NAN_CODE=HIF8_NAN)
    return codes

