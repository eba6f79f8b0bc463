"""OCP FP8 element codes: E4M3 (``fn``: no Inf, NaN 0x7F/0xFF, max 448) and E5M2 (max 57344).

Encoding saturates explicitly: torch's own fp32 -> float8 casts saturate for E4M3
but overflow to Inf for E5M2, so values are clamped to +-max first and the cast is
only trusted for what it does exactly, round-to-nearest-even of in-range values
(subnormals included; the tests check every midpoint).
"""

from __future__ import annotations

import torch

from fsdp_turbo.quantization.mx_formats._common import Workspace, check_codes, check_floating, row_chunks
from fsdp_turbo.quantization.mx_formats.formats import MXFormat, get_format

__all__ = ["fp8_decode", "fp8_encode", "fp8_encode_into"]


def _fp8_format(quant_format: str) -> MXFormat:
    fmt = get_format(quant_format)
    if fmt.data_dtype == torch.uint8:
        raise ValueError(f"{fmt.name} is not an FP8 format; use hif8_encode / hif8_decode")
    return fmt


def fp8_encode_into(scaled: torch.Tensor, out: torch.Tensor, fmt: MXFormat) -> None:
    """Round fp32 ``scaled`` to ``fmt`` codes in ``out`` (a float8 tensor), saturating.

    ``scaled`` is clamped in place. NaN stays NaN (with its sign); callers that need
    the canonical NaN code overwrite it.
    """
    scaled.clamp_(-fmt.max_elem, fmt.max_elem)
    out.copy_(scaled)  # RNE cast; exact for in-range values


def fp8_encode(x: torch.Tensor, quant_format: str = "E4M3") -> torch.Tensor:
    """Saturating RNE conversion of ``x`` to FP8 codes (uint8, same shape as ``x``).

    Values beyond +-max (Inf included) become +-max; NaN becomes 0x7F; -0.0 keeps its
    sign (0x80).
    """
    check_floating(x)
    fmt = _fp8_format(quant_format)
    flat = x.detach().contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=fmt.data_dtype, device=x.device)
    work = Workspace(flat.numel(), 1, x.device)
    for rows in row_chunks(flat.numel(), 1):
        chunk = flat[rows]
        xf = work.load_f32(chunk)
        if xf is chunk:  # fp32 input: clamp into the workspace, never into x
            xf = work.f32(chunk.shape).copy_(chunk)
        fp8_encode_into(xf, out[rows], fmt)
        nan = torch.isnan(chunk)
        if bool(nan.any()):
            out[rows].view(torch.uint8).masked_fill_(nan, fmt.nan_code)
    return out.view(torch.uint8).view(x.shape)


def fp8_decode(codes: torch.Tensor, quant_format: str = "E4M3") -> torch.Tensor:
    """FP8 codes (uint8 or the float8 dtype itself) to fp32."""
    check_codes(codes)
    fmt = _fp8_format(quant_format)
    return codes.view(torch.uint8).view(fmt.data_dtype).float()
