"""HiFloat8 (Huawei HiF8, arXiv 2409.16626) element codes.

Byte layout ``S | dot | Em | M``: sign-magnitude, no negative zero. The dot prefix
code (bits 6..3) picks the widths of the exponent field Em and the mantissa M:

    bits 6..3  dot    Em bits  M bits  |exponent|
    11xx       11     4        1       8..15
    10xx       10     3        2       4..7
    01xx       01     2        3       2..3
    001x       001    1        3       1
    0001       0001   0        3       0
    0000       denormal: value 2**(M - 23), M = 1..7 (M = 0: zero)

Em is sign-magnitude with an implicit leading 1: its first bit is the exponent's
sign (1 = negative), the rest are the magnitude below the implicit 1. Specials:
0x00 = 0, 0x80 = NaN, 0x6F / 0xEF = +-Inf (the slot of +-1.5 * 2**15). Largest
finite 0x6E = 2**15, smallest normal 0x7E = 2**-15, smallest denormal 0x01 = 2**-22.

Rounding is to nearest, ties away from zero, over the values themselves: a carry
moves to the next binade and re-derives the dot field (1.9375 -> 2.0 = 0x10).
So |x| >= 1.25 * 2**15 (the midpoint of 2**15 and the Inf slot) gives Inf, and
|x| < 2**-23 (half of 2**-22) gives 0; between denormals the midpoint of 2**k and
2**(k+1) is 1.5 * 2**k. Every check value of the issue decodes as stated (0x08 = 1,
0x0F = 1.875, 0x10 = 2, 0x18 = 0.5, 0x38 = 0.125, 0x60 = 256, 0x7F = 1.5 * 2**-15).

Encoding needs no per-element search. Rounding half away from zero to at most 3
mantissa bits depends only on the kept bits and the first dropped bit, never on the
sticky bits below it. So the code of an fp32 value is a function of its sign,
exponent and top 4 mantissa bits: 13 bits, one lookup in an 8192-entry table built
once from the rules above. Decoding is a 256-entry table lookup.
"""

from __future__ import annotations

import functools
import math

import torch

from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.quantization.mx_formats._common import Workspace, check_codes, check_floating, row_chunks
from fsdp_turbo.quantization.mx_formats.formats import hif8_mantissa_bits

__all__ = [
    "HIF8_MAX",
    "HIF8_MIN_DENORMAL",
    "HIF8_MIN_NORMAL",
    "HIF8_NAN",
    "HIF8_NEG_INF",
    "HIF8_POS_INF",
    "hif8_code_value",
    "hif8_decode",
    "hif8_decode_into",
    "hif8_encode",
    "hif8_encode_into",
    "hif8_encode_table",
]

HIF8_NAN = 0x80
HIF8_POS_INF = 0x6F
HIF8_NEG_INF = 0xEF
HIF8_MAX = 2.0**15
HIF8_MIN_NORMAL = 2.0**-15
HIF8_MIN_DENORMAL = 2.0**-22

_INDEX_SHIFT = 19  # fp32 bits >> 19 = sign | 8 exponent bits | top 4 mantissa bits
_INDEX_MASK = 0x1FFF


def hif8_code_value(code: int) -> float:
    """The value of one HiF8 byte, parsed field by field."""
    if not 0 <= code <= 0xFF:
        raise ValueError(f"a HiF8 code is a byte, got {code}")
    if code == HIF8_NAN:
        return math.nan
    sign = -1.0 if code & 0x80 else 1.0
    low = code & 0x7F
    if low == HIF8_POS_INF:
        return sign * math.inf
    prefix = low >> 3
    if prefix >= 0b1100:
        ebits, mbits = 4, 1
    elif prefix >= 0b1000:
        ebits, mbits = 3, 2
    elif prefix >= 0b0100:
        ebits, mbits = 2, 3
    elif prefix >= 0b0010:
        ebits, mbits = 1, 3
    elif prefix == 0b0001:
        ebits, mbits = 0, 3
    else:  # denormal (0x00 is zero: 0x80, its negative twin, is NaN)
        return sign * 2.0 ** ((low & 7) - 23) if low else 0.0
    mant = low & ((1 << mbits) - 1)
    exponent = 0
    if ebits:
        field = (low >> mbits) & ((1 << ebits) - 1)
        magnitude = (1 << (ebits - 1)) | (field & ((1 << (ebits - 1)) - 1))  # implicit leading 1
        exponent = -magnitude if field >> (ebits - 1) else magnitude
    return sign * (1.0 + mant / (1 << mbits)) * 2.0**exponent


def _normal_code(exponent: int, mant: int) -> int:
    """Magnitude code (7 bits) of ``(1 + mant / 2**m) * 2**exponent``, |exponent| <= 15."""
    magnitude, negative = abs(exponent), int(exponent < 0)
    if magnitude == 0:
        return 0b0001 << 3 | mant
    if magnitude == 1:
        return 0b001 << 4 | negative << 3 | mant
    if magnitude <= 3:
        return 0b01 << 5 | negative << 4 | (magnitude - 2) << 3 | mant
    if magnitude <= 7:
        return 0b10 << 5 | negative << 4 | (magnitude - 4) << 2 | mant
    return 0b11 << 5 | negative << 4 | (magnitude - 8) << 1 | mant


def _code_of_index(index: int) -> int:
    """HiF8 code of every fp32 whose bits >> 19 equal ``index`` (NaN aside)."""
    sign, biased, top4 = index >> 12, (index >> 4) & 0xFF, index & 0xF
    exponent = biased - 127
    if biased == 0xFF or exponent >= 16:
        magnitude = HIF8_POS_INF  # Inf, or beyond 2 * 2**15: always past the Inf threshold
    elif biased == 0 or exponent < -23:
        magnitude = 0  # fp32 zero / subnormal, or below 2**-23
    elif exponent == -23:
        magnitude = 1  # [2**-23, 2**-22): the midpoint 2**-23 and above round away to 2**-22
    else:
        mbits = 0 if exponent < -15 else hif8_mantissa_bits(exponent)  # denormals: powers of two only
        mant = (top4 >> (4 - mbits)) + (top4 >> (3 - mbits) & 1)  # keep mbits, add the round bit
        if mant == 1 << mbits:  # carry into the next binade
            exponent, mant = exponent + 1, 0
        if exponent > 15 or (exponent == 15 and mant):
            magnitude = HIF8_POS_INF  # 1.5 * 2**15 is the Inf slot
        elif exponent < -15:
            magnitude = exponent + 23  # denormal 2**(M - 23)
        else:
            magnitude = _normal_code(exponent, mant)
    return magnitude | sign << 7 if magnitude else 0  # no negative zero


@functools.cache
def _encode_table_cpu() -> torch.Tensor:
    return torch.tensor([_code_of_index(i) for i in range(_INDEX_MASK + 1)], dtype=torch.uint8)


@functools.cache
def _decode_table_cpu() -> torch.Tensor:
    return torch.tensor([hif8_code_value(c) for c in range(256)], dtype=torch.float32)


def hif8_encode_table(device: torch.device) -> torch.Tensor:
    """The 8192-entry uint8 table from fp32 ``bits >> 19`` (sign, exponent, top 4 mantissa bits) to
    HiF8 codes (NaN maps to Inf here), on ``device``: device kernels gather from the same table."""
    return _on(_encode_table_cpu(), device)


def _on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    return table if device.type == "cpu" else _cached_on(table, str(device))


@functools.cache
def _cached_on(table: torch.Tensor, device: str) -> torch.Tensor:
    return table.to(device)


def hif8_encode_into(xf: torch.Tensor, out: torch.Tensor) -> None:
    """Encode fp32 ``xf`` into uint8 ``out`` (same number of elements, contiguous).

    ``xf`` is overwritten (its bits become table indices). NaN is not resolved here:
    its index says Inf; callers mask NaN to 0x80.
    """
    index = xf.view(torch.int32)
    index.bitwise_right_shift_(_INDEX_SHIFT).bitwise_and_(_INDEX_MASK)  # arithmetic shift; mask keeps the sign
    torch.index_select(hif8_encode_table(xf.device), 0, index.view(-1), out=out.view(-1))


def hif8_decode_into(codes: torch.Tensor, out: torch.Tensor, index: torch.Tensor) -> None:
    """fp32 values of uint8 ``codes`` into ``out``; ``index`` is an int32 scratch of the same size."""
    index.copy_(codes.view(torch.uint8))
    torch.index_select(_on(_decode_table_cpu(), codes.device), 0, index.view(-1), out=out.view(-1))


@register_op("hif8.encode")
def _hif8_encode_portable(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    work = Workspace(flat.numel(), 1, x.device)
    for rows in row_chunks(flat.numel(), 1):
        chunk = flat[rows]
        xf = work.load_f32(chunk)
        if xf is chunk:  # fp32 input: work on a copy, the encoder overwrites its input
            xf = work.f32(chunk.shape).copy_(chunk)
        hif8_encode_into(xf, out[rows])
        nan = torch.isnan(chunk)
        if bool(nan.any()):
            out[rows].masked_fill_(nan, HIF8_NAN)
    return out.view(x.shape)


@register_op("hif8.decode")
def _hif8_decode_portable(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.view(torch.uint8).reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.float32, device=codes.device)
    work = Workspace(flat.numel(), 1, codes.device)
    for rows in row_chunks(flat.numel(), 1):
        hif8_decode_into(flat[rows], out[rows], work.i32(out[rows].shape))
    return out.view(codes.shape)


def hif8_encode(x: torch.Tensor) -> torch.Tensor:
    """HiF8 codes (uint8, shape of ``x``) of a floating tensor; round half away from zero.

    |x| >= 1.25 * 2**15 and +-Inf give +-Inf (0x6F / 0xEF), NaN gives 0x80, |x| < 2**-23
    and +-0 give 0x00. float64 input rounds exactly (it narrows to fp32 with
    round-to-odd, which never moves a value across a HiF8 rounding boundary).
    """
    check_floating(x)
    return call_op("hif8.encode", x.device.type, x)


def hif8_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of HiF8 codes (uint8): 0x80 is NaN, 0x6F / 0xEF are +-Inf."""
    check_codes(codes)
    return call_op("hif8.decode", codes.device.type, codes)
