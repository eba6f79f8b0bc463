"""The MX element formats: one table row per format (E4M3, E5M2, HIF8).

Each row holds what the quantizer needs: the clamp bound ``max_elem``, the default
FLOOR target exponent ``emax_elem``, the largest finite element in every binade (the
RCEIL target for a given ``emax_elem``), the canonical NaN code, and the dtype of
``MXTensor.data``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_turbo.fsdp_turbo_config import SCALE_MODES

__all__ = ["FORMATS", "SCALE_MODES", "MXFormat", "get_format", "hif8_mantissa_bits"]


def hif8_mantissa_bits(exponent: int) -> int:
    """HiF8's tapered precision: mantissa bits of the binade ``2**exponent`` (|exponent| <= 15)."""
    magnitude = abs(exponent)
    if magnitude <= 3:
        return 3
    if magnitude <= 7:
        return 2
    return 1


@dataclass(frozen=True)
class MXFormat:
    """One element format of the MX block quantizer.

    ``max_exponent`` is the exponent of the top binade holding finite values; a
    user ``emax_elem`` must lie in ``[0, max_exponent]``. ``binade_max[e]`` is the
    largest finite element value below ``2**(e + 1)``: the RCEIL target for
    ``emax_elem = e`` (448 / 57344 for the FP8 defaults, 15 for HIF8's default 3).
    """

    name: str
    max_elem: float  # largest finite magnitude: the clamp bound of scaled elements
    emax_elem: int  # default FLOOR target: the scaled block max lands in [2**emax, 2**(emax+1))
    max_exponent: int
    binade_max: tuple[float, ...]  # indexed by emax_elem in [0, max_exponent]
    min_subnormal: float
    nan_code: int  # canonical NaN element code (what a non-finite block's elements become)
    data_dtype: torch.dtype  # dtype of MXTensor.data; .view(torch.uint8) gives the codes

    def rceil_target(self, emax_elem: int) -> float:
        return self.binade_max[emax_elem]


def _fp8_binade_max(mbits: int, max_exponent: int, max_elem: float) -> tuple[float, ...]:
    # Below the top binade every binade is full: (2 - 2**-mbits) * 2**e.
    tops = [(2.0 - 2.0**-mbits) * 2.0**e for e in range(max_exponent)]
    return (*tops, max_elem)


def _hif8_binade_max() -> tuple[float, ...]:
    # The top binade (2**15) holds 2**15 only: 1.5 * 2**15 is the Inf code.
    tops = [(2.0 - 2.0 ** -hif8_mantissa_bits(e)) * 2.0**e for e in range(15)]
    return (*tops, 2.0**15)


FORMATS: dict[str, MXFormat] = {
    "E4M3": MXFormat(
        name="E4M3",
        max_elem=448.0,
        emax_elem=8,
        max_exponent=8,
        binade_max=_fp8_binade_max(3, 8, 448.0),
        min_subnormal=2.0**-9,
        nan_code=0x7F,
        data_dtype=torch.float8_e4m3fn,
    ),
    "E5M2": MXFormat(
        name="E5M2",
        max_elem=57344.0,
        emax_elem=15,
        max_exponent=15,
        binade_max=_fp8_binade_max(2, 15, 57344.0),
        min_subnormal=2.0**-16,
        nan_code=0x7F,
        data_dtype=torch.float8_e5m2,
    ),
    "HIF8": MXFormat(
        name="HIF8",
        max_elem=2.0**15,
        emax_elem=3,  # the 3-mantissa-bit region |exponent| <= 3: block max lands in [8, 16)
        max_exponent=15,
        binade_max=_hif8_binade_max(),
        min_subnormal=2.0**-22,
        nan_code=0x80,
        data_dtype=torch.uint8,
    ),
}



def get_format(quant_format: str) -> MXFormat:
    """The table row of ``quant_format`` (case-insensitive); ValueError when unknown."""
    key = quant_format.strip().upper() if isinstance(quant_format, str) else None
    if key not in FORMATS:
        raise ValueError(f"unknown quant_format {quant_format!r}; expected one of {list(FORMATS)}")
    return FORMATS[key]
