"""HiF8 element codes: check values, all 256 codes, ties, boundaries, random cross-check."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_turbo.core.ops import registered_ops
from fsdp_turbo.quantization.mx_formats import (
    HIF8_MAX,
    HIF8_MIN_DENORMAL,
    HIF8_MIN_NORMAL,
    HIF8_NAN,
    HIF8_NEG_INF,
    HIF8_POS_INF,
    hif8_decode,
    hif8_encode,
)
from fsdp_turbo.quantization.mx_formats.hif8 import hif8_code_value
from fsdp_turbo.quantization.mx_formats.reference import (
    code_table_reference,
    encode_reference,
    hif8_round_reference,
)

ALL_CODES = torch.arange(256, dtype=torch.uint8)


def positive_grid() -> tuple[list[float], list[int]]:
    """Finite positive HiF8 values (ascending) and their codes, from the reference table."""
    pairs = sorted((v, c) for c, v in code_table_reference("HIF8").items() if c < 0x80 and 0 < v < math.inf)
    return [v for v, _ in pairs], [c for _, c in pairs]


def encode(values: list[float], dtype: torch.dtype = torch.float64) -> list[int]:
    return hif8_encode(torch.tensor(values, dtype=dtype)).tolist()


@pytest.mark.parametrize(
    ("code", "value"),
    [
        (0x00, 0.0),
        (0x08, 1.0),
        (0x0F, 1.875),
        (0x10, 2.0),
        (0x18, 0.5),
        (0x38, 0.125),
        (0x60, 256.0),
        (0x7F, 1.5 * 2**-15),
        (0x6E, 2.0**15),  # largest finite
        (0x7E, 2.0**-15),  # smallest normal
        (0x01, 2.0**-22),  # smallest denormal
        (0x07, 2.0**-16),  # largest denormal
        (0x88, -1.0),
        (0x6F, math.inf),
        (0xEF, -math.inf),
    ],
)
def test_check_values(code, value):
    assert hif8_code_value(code) == value
    assert hif8_decode(torch.tensor([code], dtype=torch.uint8)).item() == value


def test_constants():
    assert (HIF8_NAN, HIF8_POS_INF, HIF8_NEG_INF) == (0x80, 0x6F, 0xEF)
    assert (HIF8_MAX, HIF8_MIN_NORMAL, HIF8_MIN_DENORMAL) == (2.0**15, 2.0**-15, 2.0**-22)
    assert {"hif8.encode", "hif8.decode"} <= set(registered_ops())


def test_decode_matches_the_enumerated_table():
    """The bit-field parser agrees with the table spelled out from the paper's rows."""
    table = code_table_reference("HIF8")
    assert len(table) == 255 and HIF8_NAN not in table
    decoded = hif8_decode(ALL_CODES)
    assert decoded.dtype == torch.float32
    assert math.isnan(decoded[HIF8_NAN].item())
    for code in range(256):
        if code != HIF8_NAN:
            assert decoded[code].item() == table[code], hex(code)
    values, _ = positive_grid()
    assert len(values) == 126 and len(set(values)) == 126  # every finite code is distinct


def test_every_code_round_trips():
    """decode -> encode is the identity on all 256 codes (NaN -> 0x80, +-Inf -> 0x6F / 0xEF)."""
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(hif8_encode(hif8_decode(ALL_CODES).to(dtype)), ALL_CODES)
    bf16 = hif8_decode(ALL_CODES).bfloat16()  # every HiF8 value fits bf16
    assert torch.equal(hif8_encode(bf16), ALL_CODES)


def test_ties_round_away_from_zero():
    values, codes = positive_grid()
    lo = torch.tensor(values[:-1], dtype=torch.float64)
    hi = torch.tensor(values[1:], dtype=torch.float64)
    mid = (lo + hi) / 2  # exact: at most 5 significant bits
    below = torch.nextafter(mid.float(), torch.zeros(())).double()
    for sign in (1.0, -1.0):
        sign_bit = 0x80 if sign < 0 else 0
        up = [c | sign_bit for c in codes[1:]]
        down = [c | sign_bit for c in codes[:-1]]
        assert hif8_encode(sign * mid.float()).tolist() == up
        assert hif8_encode(sign * mid).tolist() == up
        assert hif8_encode(sign * below.float()).tolist() == down
        assert hif8_encode(sign * below).tolist() == down


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (40959.99, 0x6E),  # below 1.25 * 2**15: the max finite 2**15
        (40960.0, HIF8_POS_INF),  # 1.25 * 2**15: the midpoint to the Inf slot rounds away
        (-40960.0, HIF8_NEG_INF),
        (2.0**16, HIF8_POS_INF),
        (2.0**-23, 0x01),  # half of the smallest denormal rounds away to 2**-22
        (2.0**-23 * (1 - 2**-24), 0x00),  # the fp32 just below 2**-23 flushes to zero
        (-(2.0**-23) * (1 - 2**-24), 0x00),  # no negative zero
        (2.0**-22, 0x01),
        (1.5 * 2**-22, 0x02),  # between denormals the midpoint of 2**k and 2**(k+1) is 1.5 * 2**k
        (1.5 * 2**-16, 0x7E),  # largest denormal -> smallest normal
        (1.9375, 0x10),  # carry: 1.9375 -> 2.0, dot field re-derived (0001 -> 001)
        (15.5, 0x40),  # carry out of the 3-mantissa-bit region: 15.5 -> 16 (dot 10)
        (0.0, 0x00),
        (-0.0, 0x00),
        (math.inf, HIF8_POS_INF),
        (-math.inf, HIF8_NEG_INF),
        (math.nan, HIF8_NAN),
        (1e300, HIF8_POS_INF),  # float64 beyond fp32's range
        (1e-300, 0x00),
    ],
)
def test_boundaries(value, code):
    assert encode([value], torch.float64) == [code]
    if abs(value) < 3.4e38 and (value == 0 or abs(value) > 1e-38 or math.isnan(value)):
        assert encode([value], torch.float32) == [code]


def random_wide(n: int, seed: int, lo: int = -27, hi: int = 18) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=gen, dtype=torch.float64) + 1
    exp = torch.randint(lo, hi, (n,), generator=gen).double()
    sign = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    return sign * mant * torch.pow(2.0, exp)


def few_bits(n: int, seed: int) -> torch.Tensor:
    """Values with at most 6 significant bits: ties and near-ties are everywhere."""
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(-64, 65, (n,), generator=gen).double()
    return ints * torch.pow(2.0, torch.randint(-30, 16, (n,), generator=gen).double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_random_matches_the_float64_reference(dtype):
    x = torch.cat([random_wide(20000, 1), few_bits(20000, 2)]).to(dtype)
    expected = encode_reference(hif8_round_reference(x.double()), "HIF8")
    assert torch.equal(hif8_encode(x), expected)


def test_float64_in_fp32_range_has_no_double_rounding():
    """Values a hair off a midpoint in float64 must not be pulled onto it by the fp32 narrowing."""
    values, _ = positive_grid()
    mid = (torch.tensor(values[:-1], dtype=torch.float64) + torch.tensor(values[1:], dtype=torch.float64)) / 2
    eps = mid * 2.0**-40
    x = torch.cat([mid + eps, mid - eps, -(mid + eps), -(mid - eps)])
    expected = encode_reference(hif8_round_reference(x), "HIF8")
    assert torch.equal(hif8_encode(x), expected)


def test_shapes_dtypes_and_input_untouched():
    x = random_wide(3 * 5 * 7, 3).float().view(3, 5, 7)
    keep = x.clone()
    codes = hif8_encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert torch.equal(x, keep)
    assert hif8_decode(codes).shape == x.shape
    assert torch.equal(hif8_encode(x.permute(2, 1, 0)), codes.permute(2, 1, 0))  # non-contiguous
    assert hif8_encode(torch.empty(0, 4)).shape == (0, 4)


def test_errors():
    with pytest.raises(ValueError, match="floating"):
        hif8_encode(torch.arange(4))
    with pytest.raises(ValueError, match="uint8"):
        hif8_decode(torch.arange(4))
    with pytest.raises(TypeError):
        hif8_encode([1.0])
