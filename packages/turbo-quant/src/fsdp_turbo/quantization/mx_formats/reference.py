"""Slow reference implementations of the MX formats, for the tests and the bench.

Nothing here is meant to be fast. Each piece is written the plain way and shares no
code path with the kernels it checks:

* the code tables are enumerated from the format descriptions (HiF8 codes are
  spelled as bit strings from the paper's table), not parsed bit by bit;
* element rounding is float64 arithmetic: exponent by ``torch.frexp``, then
  ``torch.round`` (half to even) for FP8 and ``floor(v + 0.5)`` (half away) for HIF8;
* value -> code is an exact search in the sorted table;
* ``quantize_mx_reference`` does the block math in float64 for any axis.

``quantize_mx_naive`` is the straightforward torch version of the same algorithm
(last axis only: reshape into blocks, amax, torch.log2 + floor/ceil, divide, clamp,
cast), which the bench times against the registered kernel.
"""

from __future__ import annotations

import functools
import math

import torch

from fsdp_turbo.quantization.mx_formats.formats import get_format

__all__ = [
    "code_table_reference",
    "encode_reference",
    "fp8_round_reference",
    "hif8_round_reference",
    "quantize_mx_naive",
    "quantize_mx_reference",
]

_FP8 = {"E4M3": (3, -6), "E5M2": (2, -14)}  # (mantissa bits, min normal exponent)


@functools.cache
def code_table_reference(quant_format: str) -> dict[int, float]:
    """Every non-NaN code of ``quant_format`` with its value (+-Inf included where the format has it)."""
    name = get_format(quant_format).name
    table: dict[int, float] = {}
    if name == "HIF8":
        # (dot, exponent-field bits, mantissa bits) rows of the HiF8 paper's table.
        for dot, ebits, mbits in (("11", 4, 1), ("10", 3, 2), ("01", 2, 3), ("001", 1, 3), ("0001", 0, 3)):
            exponents = [0] if ebits == 0 else [e for e in range(-15, 16) if e and abs(e).bit_length() == ebits]
            for e in exponents:
                # Sign bit, then the magnitude without its implicit leading 1.
                field = "" if ebits == 0 else ("1" if e < 0 else "0") + format(abs(e), "b")[1:]
                for mant in range(1 << mbits):
                    bits = dot + field + format(mant, f"0{mbits}b")
                    table[int(bits, 2)] = (1 + mant / (1 << mbits)) * 2.0**e
        for m in range(1, 8):
            table[int("0000" + format(m, "03b"), 2)] = 2.0 ** (m - 23)
        table[0] = 0.0
        table[0x6F] = math.inf  # the slot of 1.5 * 2**15
        for code, value in list(table.items()):
            if code:
                table[code | 0x80] = -value
        return table
    mbits, emin = _FP8[name]
    ebits = 7 - mbits
    bias = 1 - emin
    for code in range(128):
        biased, mant = code >> mbits, code & ((1 << mbits) - 1)
        lead = 1 if biased else 0  # subnormals: no implicit 1, exponent emin
        value = (lead + mant / (1 << mbits)) * 2.0 ** (max(biased, 1) - bias)
        if name == "E4M3" and code == 0x7F:
            continue  # NaN
        if name == "E5M2" and biased == (1 << ebits) - 1:
            if mant:
                continue  # NaN
            value = math.inf
        table[code], table[code | 0x80] = value, -value
    return table


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of positive float64 ``a``, exactly (frexp: a = m * 2**e, m in [0.5, 1))."""
    return torch.frexp(a).exponent.to(torch.float64) - 1


def fp8_round_reference(v: torch.Tensor, quant_format: str) -> torch.Tensor:
    """float64 ``v`` clamped to +-max and rounded to the FP8 grid, ties to even (NaN stays)."""
    fmt = get_format(quant_format)
    mbits, emin = _FP8[fmt.name]
    v = v.double().clamp(-fmt.max_elem, fmt.max_elem)
    a = v.abs()
    e = torch.where(a > 0, _floor_log2(a), emin).clamp(min=emin)  # subnormals share emin's step
    step = torch.pow(2.0, e - mbits)
    return torch.copysign(torch.round(a / step) * step, v)


def hif8_round_reference(v: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``v`` rounded to the HiF8 grid in ``dtype``, ties away from zero; overflow gives +-Inf.

    float32 is exact too for inputs that are float32 already: every step is a power of two
    and HiF8 keeps at most 3 mantissa bits, far inside float32's 24."""
    v = v.to(dtype)
    a = v.abs()
    e = torch.where(a > 0, torch.frexp(a).exponent.to(dtype) - 1, -1000.0)
    mbits = torch.where(e.abs() <= 3, 3, torch.where(e.abs() <= 7, 2, 1))
    mbits = torch.where(e < -15, 0, mbits)  # denormals are powers of two
    step = torch.pow(2.0, e - mbits)
    q = torch.floor(a / step + 0.5) * step
    q = torch.where(a < 2.0**-22, torch.where(a >= 2.0**-23, 2.0**-22, 0.0), q)
    q = torch.where(q >= 1.5 * 2.0**15, math.inf, q)
    return torch.where(torch.isnan(v), v, torch.copysign(q, v))


def encode_reference(values: torch.Tensor, quant_format: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Codes (uint8) of values that are already on the grid of ``quant_format`` (searched in
    ``dtype``; every FP8 and HiF8 value is exact in float32).

    NaN gives the format's canonical NaN code. FP8 zero keeps its sign (-0.0 -> 0x80);
    HiF8 has no negative zero.
    """
    fmt = get_format(quant_format)
    table = code_table_reference(fmt.name)
    positive = sorted((value, code) for code, value in table.items() if code < 0x80)
    grid = torch.tensor([value for value, _ in positive], dtype=dtype)
    codes = torch.tensor([code for _, code in positive], dtype=torch.int64)
    v = values.to(dtype).contiguous()
    a = v.abs()
    index = torch.searchsorted(grid, torch.where(torch.isnan(a), 0.0, a)).clamp(max=len(positive) - 1)
    found = grid[index] == a
    if not bool((found | torch.isnan(a)).all()):
        raise ValueError(f"values off the {fmt.name} grid: {a[~(found | torch.isnan(a))][:5].tolist()}")
    out = codes[index]
    negative = torch.signbit(v) & (out != 0 if fmt.name == "HIF8" else True)
    out = out | negative.to(torch.int64) << 7
    return torch.where(torch.isnan(v), fmt.nan_code, out).to(torch.uint8)


def _round(v: torch.Tensor, name: str) -> torch.Tensor:
    return hif8_round_reference(v) if name == "HIF8" else fp8_round_reference(v, name)


def _block_exponents(amax: torch.Tensor, name: str, scale_mode: str, emax: int) -> torch.Tensor:
    """float64 block exponents (clamped, tiny-amax policy applied) of float64 ``amax``."""
    fmt = get_format(name)
    if scale_mode == "floor":
        s = _floor_log2(amax) - emax
    else:
        q = amax / fmt.rceil_target(emax)
        mant, exp = torch.frexp(q)
        s = exp.to(torch.float64) - (mant == 0.5).to(torch.float64)  # ceil(log2(q)), exactly
    s = torch.where(amax < 2.0**-126, -127.0, s)
    return s.clamp(-127, 127)


def quantize_mx_reference(
    x: torch.Tensor,
    quant_format: str = "E4M3",
    block_size: int = 32,
    scale_mode: str = "floor",
    axis: int = -1,
    emax_elem: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(element codes shaped like ``x``, E8M0 scale bytes) in float64 math, any axis. Slow."""
    fmt = get_format(quant_format)
    emax = fmt.emax_elem if emax_elem is None else emax_elem
    axis = axis % x.dim()
    moved = x.detach().double().movedim(axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN propagates
    finite = torch.isfinite(amax)
    s = _block_exponents(torch.where(finite, amax, 1.0), fmt.name, scale_mode, emax)
    scaled = (blocks / torch.pow(2.0, s)).clamp(-fmt.max_elem, fmt.max_elem)
    codes = encode_reference(_round(scaled, fmt.name), fmt.name)
    codes = torch.where(finite, codes, fmt.nan_code)
    scale = torch.where(finite, s + 127, 255.0).squeeze(-1).to(torch.uint8)
    return codes.reshape(moved.shape).movedim(-1, axis), scale.movedim(-1, axis)


def quantize_mx_naive(
    x: torch.Tensor,
    quant_format: str = "E4M3",
    block_size: int = 32,
    scale_mode: str = "floor",
    emax_elem: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain torch version along the last axis: (codes, scale bytes), both uint8.

    fp32 throughout (float64 input is narrowed with ``.float()`` first) except the
    per-block log2 (float64, so that floor/ceil never round across a power of two).
    FP8 elements use torch's float8 cast after the clamp; HIF8 elements are rounded and
    looked up on the grid in float32 (exact: see ``hif8_round_reference``), as a plain
    vectorised encoder would; the float64 reference is the slow, obviously-right one.
    """
    fmt = get_format(quant_format)
    emax = fmt.emax_elem if emax_elem is None else emax_elem
    blocks = x.detach().float().reshape(-1, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    if scale_mode == "floor":
        s = torch.floor(torch.log2(amax.double())) - emax
    else:
        s = torch.ceil(torch.log2(amax.double() / fmt.rceil_target(emax)))
    s = torch.where(amax < 2.0**-126, -127.0, s).clamp(-127, 127)
    s = torch.where(finite, s, 0.0)
    scaled = (blocks / torch.exp2(s).float()).clamp(-fmt.max_elem, fmt.max_elem)
    if fmt.name == "HIF8":
        codes = encode_reference(hif8_round_reference(scaled, torch.float32), "HIF8", torch.float32)
    else:
        codes = scaled.to(fmt.data_dtype).view(torch.uint8)
    codes = torch.where(finite, codes, fmt.nan_code)
    scale = torch.where(finite, s + 127, 255.0).to(torch.uint8)
    return codes.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // block_size)
