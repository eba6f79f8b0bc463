"""E8M0 block scales: byte ``S`` means ``2**(S - 127)``; ``0xFF`` is NaN.

The scale exponent of a block is computed from the bit pattern of its amax (fp32, or
float64 for float64 input) with integer ops only (no log2, so no rounding at powers
of two):

* FLOOR (OCP MX v1.0): ``s = floor(log2(amax)) - emax_elem``; ``floor(log2(amax))`` is
  amax's unbiased exponent field.
* RCEIL (NVIDIA MXFP8): ``s = ceil(log2(amax / target))``. With ``amax = ma * 2**ea`` and
  ``target = mt * 2**et`` (``ma, mt`` in [1, 2)), ``amax / target`` has ``ceil(log2) =
  ea - et + (ma > mt)``: one integer compare of the mantissa fields. This equals
  ``e + (mantissa != 0)`` of the fp32 quotient ``amax / target`` whenever that
  quotient is normal (the targets have at most 4 significant bits, so the correctly
  rounded quotient can never land on a power of two from above), and stays exact
  where the quotient would be an fp32 subnormal.

Policy, the same in both modes:

* amax below the smallest normal fp32 (2**-126), all-zero blocks included: the
  minimum scale, exponent -127 (byte 0x00);
* amax Inf or NaN (the block holds an Inf or a NaN): byte 0xFF (NaN);
* every other exponent is clamped into E8M0's range [-127, 127].
"""

from __future__ import annotations

import torch

__all__ = [
    "E8M0_BIAS",
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "E8M0_NAN",
    "block_scale_exponents",
    "e8m0_to_float32",
    "pow2_float32",
    "pow2_float64",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127

# (mantissa bits, exponent bias, float dtype) of the layouts amax bits may come in, by int dtype.
_LAYOUTS = {torch.int32: (23, 127, torch.float32), torch.int64: (52, 1023, torch.float64)}


def _fields(value: float, int_dtype: torch.dtype) -> tuple[int, int]:
    """(unbiased exponent, mantissa field) of a normal ``value`` in the float layout of ``int_dtype``."""
    mant_bits, bias, float_dtype = _LAYOUTS[int_dtype]
    bits = int(torch.tensor(value, dtype=float_dtype).view(int_dtype))
    return (bits >> mant_bits) - bias, bits & ((1 << mant_bits) - 1)


def block_scale_exponents(
    amax_bits: torch.Tensor, scale_mode: str, emax_elem: int, target: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale exponents and E8M0 bytes of blocks from the bits of their |amax|.

    ``amax_bits`` holds non-negative bit patterns (sign cleared) of fp32 (int32) or
    float64 (int64) values; NaN patterns sort above Inf, so an integer max over ``|x|``
    bits keeps any NaN. Returns ``(s, codes)``: int32 exponents clamped to [-127, 127]
    and uint8 E8M0 bytes (0xFF where amax is Inf/NaN). ``target`` is the RCEIL target
    (ignored by FLOOR).
    """
    mant_bits, bias, _ = _LAYOUTS[amax_bits.dtype]
    biased = amax_bits >> mant_bits  # all ones: Inf or NaN
    exponent = biased - bias
    if scale_mode == "floor":
        s = exponent - emax_elem
    elif scale_mode == "rceil":
        t_exp, t_man = _fields(target, amax_bits.dtype)
        s = exponent - t_exp + ((amax_bits & ((1 << mant_bits) - 1)) > t_man).to(exponent.dtype)
    else:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; expected 'floor' or 'rceil'")
    # Tiny-amax policy: below 2**-126 (zero included) take the minimum scale.
    s = torch.where(exponent < -126, E8M0_MIN_EXP, s).clamp_(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)
    nonfinite = biased == (1 << (amax_bits.element_size() * 8 - 1 - mant_bits)) - 1
    codes = torch.where(nonfinite, E8M0_NAN, s + E8M0_BIAS).to(torch.uint8)
    return s, codes


def pow2_float32(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2.0**exponent`` in fp32 for int exponents in [-127, 127] (2**-127 is subnormal)."""
    exponent = exponent.to(torch.int32)
    bits = torch.where(exponent >= -126, (exponent + 127) << 23, 1 << 22)
    return bits.view(torch.float32)


def pow2_float64(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2.0**exponent`` in float64 for int exponents in [-1022, 1023]."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def e8m0_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) to fp32: ``2**(S - 127)``, NaN for 0xFF."""
    s = codes.view(torch.uint8).to(torch.int32)
    values = pow2_float32(s - E8M0_BIAS)
    return torch.where(s == E8M0_NAN, float("nan"), values)
