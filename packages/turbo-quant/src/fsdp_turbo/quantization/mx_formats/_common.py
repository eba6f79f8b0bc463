"""Helpers shared by the MX kernels: fp32 narrowing, chunking and argument checks."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

# Kernels walk big tensors in chunks of about this many elements through one
# preallocated workspace: a fresh multi-MiB temporary per op is mapped and
# page-faulted anew by the allocator, which costs more than the op itself on CPU.
CHUNK_ELEMS = 1 << 20


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as fp32, without changing the code it rounds to in any element format.

    fp32 is returned as is (no copy); bf16 / fp16 / float8 widen exactly. float64
    narrows with round-to-odd (truncate, then set the last bit when inexact): rounding
    that again to a format with at most 22 significand bits gives what rounding the
    float64 value directly would, so values in fp32's normal range see no double
    rounding. Magnitudes beyond fp32's range saturate to its max (or its smallest
    subnormal, 2**-149).
    """
    if x.dtype == torch.float32:
        return x
    if x.dtype != torch.float64:
        return x.float()
    y = x.float()
    back = y.double()
    inexact = back != x  # NaN compares unequal; NaN | 1 stays NaN
    away = inexact & (back.abs() > x.abs())  # RNE went away from zero: step one ulp back
    bits = y.view(torch.int32) - away.to(torch.int32)
    return (bits | inexact.to(torch.int32)).view(torch.float32)


def _rows_per_chunk(row_elems: int) -> int:
    return max(1, CHUNK_ELEMS // max(1, row_elems))


def row_chunks(rows: int, row_elems: int) -> Iterator[slice]:
    """Slices of whole rows, about ``CHUNK_ELEMS`` elements each (at least one row)."""
    step = _rows_per_chunk(row_elems)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


class Workspace:
    """Reusable fp32 and int32 buffers for the chunks of one call (their views share no storage)."""

    def __init__(self, rows: int, row_elems: int, device: torch.device) -> None:
        size = min(rows, _rows_per_chunk(row_elems)) * row_elems
        self._f32 = torch.empty(size, dtype=torch.float32, device=device)
        self._i32 = torch.empty(size, dtype=torch.int32, device=device)

    def f32(self, shape: torch.Size) -> torch.Tensor:
        return self._f32[: math.prod(shape)].view(shape)

    def i32(self, shape: torch.Size) -> torch.Tensor:
        return self._i32[: math.prod(shape)].view(shape)

    def load_f32(self, x: torch.Tensor) -> torch.Tensor:
        """``as_float32(x)`` in the fp32 buffer (fp32 input is returned as is, not copied)."""
        if x.dtype == torch.float32:
            return x
        if x.dtype == torch.float64:
            return self.f32(x.shape).copy_(as_float32(x))
        return self.f32(x.shape).copy_(x)  # exact widening


def check_floating(x: object, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    return x


def check_codes(codes: object, name: str = "codes") -> torch.Tensor:
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype not in _CODE_DTYPES:
        raise ValueError(f"{name} must be uint8 or a float8 dtype (one code per byte), got {codes.dtype}")
    return codes


_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_CODE_DTYPES = (torch.uint8, *(getattr(torch, name) for name in _FLOAT8_NAMES if hasattr(torch, name)))
