"""MX block quantization: E8M0 scales, FP8 element codes, quantize_mx / dequantize_mx.

Expected bytes are worked out by hand where marked; everything else is cross-checked
bit-exactly against the float64 reference (and the plain torch version) in
``fsdp_turbo.quantization.mx_formats.reference``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from fsdp_turbo.core.ops import registered_ops
from fsdp_turbo.quantization.mx_formats import (
    FORMATS,
    MXTensor,
    _common,
    dequantize_mx,
    e8m0_to_float32,
    fp8_decode,
    fp8_encode,
    quantize_mx,
)
from fsdp_turbo.quantization.mx_formats.e8m0 import block_scale_exponents
from fsdp_turbo.quantization.mx_formats.reference import (
    code_table_reference,
    encode_reference,
    fp8_round_reference,
    quantize_mx_naive,
    quantize_mx_reference,
)

FP8 = ("E4M3", "E5M2")
ALL_CODES = torch.arange(256, dtype=torch.uint8)


def table_values(quant_format: str) -> torch.Tensor:
    """float64 value of every code (NaN where the code is NaN), from the reference table."""
    table = code_table_reference(quant_format)
    return torch.tensor([table.get(c, math.nan) for c in range(256)], dtype=torch.float64)


# ---------------------------------------------------------------- FP8 element codes


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_decode_matches_the_reference_table(fmt):
    decoded = fp8_decode(ALL_CODES, fmt)
    expected = table_values(fmt).float()
    assert torch.equal(torch.isnan(decoded), torch.isnan(expected))
    ok = ~torch.isnan(expected)
    assert torch.equal(decoded[ok], expected[ok])


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_ties_to_even_subnormals_included(fmt, dtype):
    """Every midpoint between adjacent values (0 | subnormals | normals) rounds to the even code."""
    pairs = sorted((v, c) for c, v in code_table_reference(fmt).items() if c < 0x80 and v < math.inf)
    values = torch.tensor([v for v, _ in pairs], dtype=torch.float64)
    codes = [c for _, c in pairs]
    mid = (values[:-1] + values[1:]) / 2
    even = [lo if lo % 2 == 0 else hi for lo, hi in itertools.pairwise(codes)]
    above = torch.nextafter(mid.to(dtype), torch.tensor(math.inf, dtype=dtype))
    below = torch.nextafter(mid.to(dtype), torch.tensor(0.0, dtype=dtype))
    assert fp8_encode(mid.to(dtype), fmt).tolist() == even
    assert fp8_encode(-mid.to(dtype), fmt).tolist() == [c | 0x80 for c in even]
    assert fp8_encode(above, fmt).tolist() == codes[1:]
    assert fp8_encode(below, fmt).tolist() == codes[:-1]


@pytest.mark.parametrize(
    ("fmt", "values", "codes"),
    [
        ("E4M3", [448.0, 464.0, 1e6, math.inf, -math.inf, math.nan, -0.0], [126, 126, 126, 126, 254, 127, 128]),
        ("E5M2", [57344.0, 61440.0, 1e6, math.inf, -math.inf, math.nan, -0.0], [123, 123, 123, 123, 251, 127, 128]),
    ],
)
def test_fp8_saturates_and_nan(fmt, values, codes):
    for dtype in (torch.float32, torch.float64):
        assert fp8_encode(torch.tensor(values, dtype=dtype), fmt).tolist() == codes


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fp8_random_matches_the_float64_reference(fmt, dtype):
    x = wide_values(30000, seed=5).to(dtype)
    assert torch.equal(fp8_encode(x, fmt), encode_reference(fp8_round_reference(x.double(), fmt), fmt))


# ---------------------------------------------------------------- E8M0 scales


def test_e8m0_values():
    values = e8m0_to_float32(ALL_CODES)
    assert values.dtype == torch.float32
    assert values[0].item() == math.ldexp(1.0, -127)  # fp32 subnormal, exact
    assert values[127].item() == 1.0 and values[254].item() == 2.0**127
    assert math.isnan(values[255].item())
    assert torch.equal(values[:255].double(), torch.pow(2.0, torch.arange(255, dtype=torch.float64) - 127))


@pytest.mark.parametrize("target", sorted({t for f in FORMATS.values() for t in f.binade_max}))
def test_rceil_equals_the_fp32_quotient_formula(target):
    """S = ea - et + (ma > mt) equals e + (mantissa != 0) of fp32(amax / target) (normal quotients)."""
    gen = torch.Generator().manual_seed(int(target * 8) % 1000)
    amax = (torch.rand(20000, generator=gen) + 1) * torch.pow(2.0, torch.randint(-100, 120, (20000,), generator=gen))
    exact = target * torch.pow(2.0, torch.arange(-100, 110).float())  # quotient exactly a power of two
    inf = torch.tensor(math.inf)
    amax = torch.cat([amax, exact, torch.nextafter(exact, inf), torch.nextafter(exact, -inf)])
    q_bits = (amax / target).view(torch.int32)
    q_exp, q_man = q_bits >> 23, q_bits & 0x7FFFFF
    assert bool((q_exp > 0).all())
    expected = (q_exp - 127 + (q_man != 0).int()).clamp(-127, 127)
    s, codes = block_scale_exponents(amax.view(torch.int32), "rceil", 0, target)
    assert torch.equal(s, expected)
    assert torch.equal(codes, (expected + 127).to(torch.uint8))


# ---------------------------------------------------------------- hand-computed blocks

SCALE_CASES = [
    # (format, mode, emax_elem, amax, expected E8M0 byte) -- worked out by hand:
    # floor: 127 + floor(log2(amax)) - emax;  rceil: 127 + ceil(log2(amax / target)).
    ("E4M3", "floor", None, 1.0, 119),
    ("E4M3", "floor", None, 0.75, 118),
    ("E4M3", "floor", None, 240.0, 126),
    ("E4M3", "floor", None, 448.0, 127),
    ("E4M3", "floor", None, 450.0, 127),
    ("E4M3", "floor", None, 3.515625, 120),
    ("E4M3", "floor", None, 2.0**-100, 19),
    ("E4M3", "rceil", None, 1.0, 119),  # ceil(log2(1/448)) = ceil(-8.81) = -8
    ("E4M3", "rceil", None, 0.75, 118),  # ceil(-9.22) = -9
    ("E4M3", "rceil", None, 240.0, 127),  # ceil(-0.90) = 0
    ("E4M3", "rceil", None, 448.0, 127),  # exactly 0
    ("E4M3", "rceil", None, 450.0, 128),  # just above: 1
    ("E4M3", "rceil", None, 3.5, 120),  # 448 / 128: exactly -7
    ("E4M3", "rceil", None, 3.515625, 121),  # just above: -6
    ("E4M3", "rceil", None, 2.0**-100, 19),  # ceil(-108.81) = -108
    ("E5M2", "floor", None, 1.0, 112),
    ("E5M2", "floor", None, 240.0, 119),
    ("E5M2", "floor", None, 57344.0, 127),
    ("E5M2", "floor", None, 61440.0, 127),
    ("E5M2", "rceil", None, 1.0, 112),  # ceil(log2(1/57344)) = ceil(-15.81) = -15
    ("E5M2", "rceil", None, 240.0, 120),  # ceil(-7.90) = -7
    ("E5M2", "rceil", None, 57344.0, 127),
    ("E5M2", "rceil", None, 61440.0, 128),
    ("HIF8", "floor", None, 1.0, 124),  # emax 3: scaled max in [8, 16)
    ("HIF8", "floor", None, 7.5, 126),
    ("HIF8", "floor", None, 15.0, 127),
    ("HIF8", "floor", None, 16.0, 128),
    ("HIF8", "floor", None, 240.0, 131),
    ("HIF8", "rceil", None, 1.0, 124),  # target 15: ceil(log2(1/15)) = ceil(-3.91) = -3
    ("HIF8", "rceil", None, 7.5, 126),  # exactly -1
    ("HIF8", "rceil", None, 15.0, 127),
    ("HIF8", "rceil", None, 16.0, 128),
    ("HIF8", "rceil", None, 240.0, 131),  # 240 / 15 = 16: exactly 4
    ("HIF8", "rceil", None, 241.0, 132),
    ("HIF8", "floor", 7, 1.0, 120),  # emax 7: scaled max in [128, 256)
    ("HIF8", "floor", 7, 240.0, 127),
    ("HIF8", "floor", 7, 256.0, 128),
    ("HIF8", "rceil", 7, 1.0, 120),  # target 224: ceil(log2(1/224)) = ceil(-7.81) = -7
    ("HIF8", "rceil", 7, 112.0, 126),
    ("HIF8", "rceil", 7, 224.0, 127),
    ("HIF8", "rceil", 7, 240.0, 128),
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "mode", "emax", "amax", "byte"), SCALE_CASES)
def test_scale_bytes_by_hand(fmt, mode, emax, amax, byte, dtype, block_size):
    # Three blocks: the case (amax carried by a negative element), a block with amax 2**10
    # around it, so blocks must not leak into each other.
    ramp = torch.linspace(-0.9, 0.9, block_size, dtype=torch.float64)
    block = ramp * amax
    block[3] = -amax
    other = ramp * 2.0**10
    x = torch.cat([other, block, other]).to(dtype).view(1, -1)
    assert x[0, block_size + 3].item() == -amax  # representable in dtype
    mx = quantize_mx(x, fmt, block_size, mode, emax_elem=emax)
    assert mx.scale.shape == (1, 3)
    assert mx.scale[0, 1].item() == byte
    codes, scale = quantize_mx_reference(x, fmt, block_size, mode, emax_elem=emax)
    assert torch.equal(mx.scale, scale) and torch.equal(mx.codes, codes)


def test_element_codes_by_hand():
    x = torch.tensor([[-1.0, 0.5, 0.3, 0.0]])
    # E4M3 floor: s = 0 - 8 -> elements * 256: -256 (0xF8), 128 (0x70), 76.8 -> 80 (0x6A), 0.
    mx = quantize_mx(x, "E4M3", 4)
    assert mx.scale.tolist() == [[119]] and mx.codes.tolist() == [[0xF8, 0x70, 0x6A, 0x00]]
    # HIF8 floor (emax 3): s = -3 -> elements * 8: -8 (0xA8), 4 (0x20), 2.4 -> 2.5 (0x12), 0.
    mx = quantize_mx(x, "HIF8", 4)
    assert mx.scale.tolist() == [[124]] and mx.codes.tolist() == [[0xA8, 0x20, 0x12, 0x00]]
    assert dequantize_mx(mx).tolist() == [[-1.0, 0.5, 0.3125, 0.0]]


# ---------------------------------------------------------------- random cross-checks


def wide_values(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=gen, dtype=torch.float64) + 1
    exp = torch.randint(-30, 20, (n,), generator=gen).double()
    sign = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    return sign * mant * torch.pow(2.0, exp)


def mx_input(shape: tuple[int, ...], axis: int, block_size: int, seed: int) -> torch.Tensor:
    """float64 test data: per-block magnitudes from 2**-135 to 2**100, exact ties, specials."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    ties = torch.randint(-64, 65, shape, generator=gen).double() / 8  # few bits: ties after scaling
    x = torch.where(torch.rand(shape, generator=gen) < 0.3, ties, x)
    nblocks = shape[axis] // block_size
    block_shape = list(shape)
    block_shape[axis] = nblocks
    exps = torch.randint(-135, 100, block_shape, generator=gen).double()
    x = x * torch.pow(2.0, exps).repeat_interleave(block_size, dim=axis)
    flat = x.movedim(axis, -1).reshape(-1, block_size)
    flat[0] = 0.0  # an all-zero block
    flat[1, 2] = math.inf
    flat[2, 0] = math.nan
    flat[3, 1] = -math.inf
    flat[4] *= 2.0**-140  # amax below fp32's smallest normal
    return flat.reshape(x.movedim(axis, -1).shape).movedim(-1, axis).contiguous()


CROSS = [(fmt, mode) for fmt in FORMATS for mode in ("floor", "rceil")]


@pytest.mark.parametrize(("fmt", "mode"), CROSS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_random_matches_the_references(fmt, mode, dtype, block_size):
    x = mx_input((24, 128), 1, block_size, seed=block_size).to(dtype)
    mx = quantize_mx(x, fmt, block_size, mode)
    codes, scale = quantize_mx_reference(x, fmt, block_size, mode)
    assert torch.equal(mx.scale, scale)
    assert torch.equal(mx.codes, codes)
    if dtype != torch.float64:  # the plain torch version narrows with .float() (RNE) first
        naive_codes, naive_scale = quantize_mx_naive(x, fmt, block_size, mode)
        assert torch.equal(naive_scale, scale) and torch.equal(naive_codes, codes)
    # Dequantized values are the reference's element values times the scale, exactly.
    elem = table_values(fmt)[codes.long()]
    factor = torch.where(scale == 255, math.nan, torch.pow(2.0, scale.double() - 127))
    expected = elem * factor.repeat_interleave(block_size, dim=1)
    got = dequantize_mx(mx, torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    ok = ~torch.isnan(expected)
    assert torch.equal(got[ok], expected[ok])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("emax", [0, 2, 7, 15])
def test_configurable_emax_matches_the_reference(fmt, emax):
    emax = min(emax, FORMATS[fmt].max_exponent)
    x = mx_input((8, 64), 1, 32, seed=emax)
    for mode in ("floor", "rceil"):
        mx = quantize_mx(x, fmt, 32, mode, emax_elem=emax)
        codes, scale = quantize_mx_reference(x, fmt, 32, mode, emax_elem=emax)
        assert mx.emax_elem == emax
        assert torch.equal(mx.scale, scale) and torch.equal(mx.codes, codes)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_other_axes(fmt):
    x = mx_input((64, 48), 0, 32, seed=7).float()
    mx = quantize_mx(x, fmt, 32, axis=0)
    assert mx.axis == 0 and mx.data.shape == (64, 48) and mx.scale.shape == (2, 48)
    along_rows = quantize_mx(x.t().contiguous(), fmt, 32, axis=-1)
    assert torch.equal(mx.codes, along_rows.codes.t()) and torch.equal(mx.scale, along_rows.scale.t())
    codes, scale = quantize_mx_reference(x, fmt, 32, axis=0)
    assert torch.equal(mx.codes, codes) and torch.equal(mx.scale, scale)
    got, want = dequantize_mx(mx), dequantize_mx(along_rows).t()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num())

    y = mx_input((3, 32, 5), 1, 16, seed=8).float()
    mx = quantize_mx(y, fmt, 16, "rceil", axis=-2)
    assert mx.axis == 1 and mx.scale.shape == (3, 2, 5)
    codes, scale = quantize_mx_reference(y, fmt, 16, "rceil", axis=1)
    assert torch.equal(mx.codes, codes) and torch.equal(mx.scale, scale)
    assert quantize_mx(y.transpose(0, 2), fmt, 16, axis=1).scale.shape == (5, 2, 3)  # non-contiguous input


def test_chunking_does_not_change_results(monkeypatch):
    x = mx_input((40, 96), 1, 32, seed=9).float()
    whole = {fmt: quantize_mx(x, fmt, 32, axis=ax) for fmt in FORMATS for ax in (0, 1) if x.shape[ax] % 32 == 0}
    monkeypatch.setattr(_common, "CHUNK_ELEMS", 100)  # a few rows per chunk; 1 row when a row is longer
    for fmt, ref in whole.items():
        got = quantize_mx(x, fmt, 32, axis=ref.axis)
        assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale)
        assert torch.equal(dequantize_mx(got).nan_to_num(), dequantize_mx(ref).nan_to_num())


# ---------------------------------------------------------------- error bounds


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_quantize_dequantize_error_bound(fmt, mode):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 256, generator=gen) * torch.pow(2.0, torch.randint(-20, 20, (64, 8, 1), generator=gen)).repeat(
        1, 1, 32
    ).view(64, 256)
    mx = quantize_mx(x, fmt, 32, mode)
    y = dequantize_mx(mx)
    s = torch.pow(2.0, mx.scale.float() - 127).repeat_interleave(32, dim=1)
    info = FORMATS[fmt]
    mbits = {"E4M3": 3, "E5M2": 2, "HIF8": 1}[fmt]  # HiF8's fewest mantissa bits
    # Round to nearest: half an ulp of the (fewest-bit) grid, plus half the smallest step.
    bound = 2.0 ** -(mbits + 1) * x.abs() + s * info.min_subnormal / 2
    # FLOOR may clamp E4M3 / E5M2 blocks whose scaled max passes max_elem.
    bound = torch.maximum(bound, x.abs() - info.max_elem * s)
    assert bool(((y - x).abs() <= bound).all())
    # The block maxima sit where the format is most precise: half an ulp of 3 / 2 / 3 bits.
    top = x.abs() >= x.abs().view(64, 8, 32).amax(-1, keepdim=True).repeat(1, 1, 32).view(64, 256) / 2
    top_bits = {"E4M3": 3, "E5M2": 2, "HIF8": 3}[fmt]
    if mode == "rceil" or fmt == "HIF8":
        assert bool(((y - x).abs() <= 2.0 ** -(top_bits + 1) * x.abs())[top].all())
    bf16 = dequantize_mx(mx, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.float(), y)  # MX values are exact in bf16


# ---------------------------------------------------------------- policies


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_zero_nonfinite_and_tiny_blocks(fmt, mode):
    nan_code = FORMATS[fmt].nan_code
    blocks = torch.ones(6, 32)
    blocks[0] = 0.0  # all zero
    blocks[1, 5] = math.inf
    blocks[2, 7] = -math.inf
    blocks[3, 9] = math.nan
    blocks[4] = torch.linspace(-1, 1, 32) * 2.0**-130  # amax below 2**-126 (fp32 subnormals)
    blocks[4, 0] = 2.0**-130
    blocks[5] = 2.0**-126  # the smallest normal: an ordinary block
    mx = quantize_mx(blocks.view(1, -1), fmt, 32, mode)
    scale = mx.scale.view(-1).tolist()
    codes = mx.codes.view(6, 32)
    # Zero block: the minimum scale (byte 0), zero codes, zero values.
    assert scale[0] == 0 and bool((codes[0] == 0).all())
    # Inf / NaN blocks: NaN scale, every element the NaN code, every value NaN.
    assert scale[1:4] == [255, 255, 255] and bool((codes[1:4] == nan_code).all())
    y = dequantize_mx(mx).view(6, 32)
    assert bool(torch.isnan(y[1:4]).all()) and bool((y[0] == 0).all())
    # Tiny amax: the minimum scale 2**-127, elements x * 2**127 (exact, so 2**-130 -> 2**-3).
    assert scale[4] == 0
    assert y[4, 0].item() == 2.0**-130
    # 2**-126 is normal: floor gives -126 - emax, clamped to -127; rceil likewise below -127.
    assert scale[5] == 0
    assert bool((y[5] == 2.0**-126).all())
    codes_ref, scale_ref = quantize_mx_reference(blocks.view(1, -1), fmt, 32, mode)
    assert torch.equal(mx.codes, codes_ref) and torch.equal(mx.scale, scale_ref)


def test_scale_exponents_clamp_to_e8m0_range():
    # RCEIL with HIF8 emax_elem 0 (target 1.875): amax = fp32 max needs s = 128 -> clamped to 127.
    big = torch.full((1, 32), torch.finfo(torch.float32).max)
    mx = quantize_mx(big, "HIF8", 32, "rceil", emax_elem=0)
    assert mx.scale.item() == 254 and bool((mx.codes == 0x10).all())  # 1.99.. -> 2.0
    # FLOOR with amax 2**-120: -120 - 8 = -128 -> clamped to -127.
    assert quantize_mx(torch.full((1, 32), 2.0**-120), "E4M3").scale.item() == 0
    # float64 beyond fp32's range: floor(log2(1e300)) - 8 = 988 -> 127; elements clamp to 448.
    huge = quantize_mx(torch.full((1, 32), 1e300, dtype=torch.float64), "E4M3")
    assert huge.scale.item() == 254 and bool((huge.codes == 0x7E).all())
    assert dequantize_mx(huge, torch.float64).unique().tolist() == [448 * 2.0**127]


def test_e5m2_overflow_clamps_not_inf():
    x = torch.tensor([[65535.0, -65535.0, 60000.0, 1.0]])
    mx = quantize_mx(x, "E5M2", 4, "floor")  # floor(log2 65535) - 15 = 0: scaled = x
    assert mx.scale.item() == 127
    assert mx.codes.tolist() == [[0x7B, 0xFB, 0x7B, 0x3C]]
    assert dequantize_mx(mx).tolist() == [[57344.0, -57344.0, 57344.0, 1.0]]
    e4m3 = quantize_mx(torch.tensor([[500.0, -511.0, 1.0, 0.0]]), "E4M3", 4, "floor")
    assert e4m3.codes.tolist() == [[0x7E, 0xFE, 0x38, 0x00]]


# ---------------------------------------------------------------- API and errors


def test_mxtensor_record():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    keep = x.clone()
    for fmt, dtype in (("E4M3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2), ("HIF8", torch.uint8)):
        mx = quantize_mx(x, fmt, 16, "RCEIL", axis=-1)
        assert not isinstance(mx, torch.Tensor) and isinstance(mx, MXTensor)
        assert mx.data.dtype == dtype and mx.codes.dtype == torch.uint8 and mx.data.shape == x.shape
        assert mx.scale.dtype == torch.uint8 and mx.scale.shape == (4, 4)
        assert (mx.quant_format, mx.block_size, mx.axis, mx.scale_mode) == (fmt.upper(), 16, 1, "rceil")
        assert mx.emax_elem == FORMATS[fmt.upper()].emax_elem
        assert mx.orig_dtype == torch.bfloat16 and mx.orig_shape == x.shape
        assert torch.equal(mx.dequantize(), dequantize_mx(mx))
        with pytest.raises(dataclasses.FrozenInstanceError):
            mx.block_size = 32
    assert torch.equal(x, keep)
    assert {"mx.quantize", "mx.dequantize"} <= set(registered_ops())


def test_empty_tensor():
    mx = quantize_mx(torch.empty(0, 64), "E4M3")
    assert mx.data.shape == (0, 64) and mx.scale.shape == (0, 2)
    assert dequantize_mx(mx).shape == (0, 64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 48}, "does not divide"),
        ({"block_size": 0}, "positive int"),
        ({"block_size": -32}, "positive int"),
        ({"block_size": 32.0}, "positive int"),
        ({"block_size": True}, "positive int"),
        ({"quant_format": "E3M4"}, "unknown quant_format"),
        ({"quant_format": None}, "unknown quant_format"),
        ({"scale_mode": "ceil"}, "unknown scale_mode"),
        ({"axis": 2}, "out of range"),
        ({"emax_elem": 9}, "emax_elem"),
        ({"emax_elem": -1}, "emax_elem"),
    ],
)
def test_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_mx(torch.randn(4, 64), **kwargs)


@pytest.mark.parametrize(
    "x", [torch.arange(64).view(2, 32), torch.ones(2, 32, dtype=torch.bool), torch.ones(2, 32).cfloat()]
)
def test_non_floating_input(x):
    with pytest.raises(ValueError, match="floating"):
        quantize_mx(x)


def test_more_errors():
    with pytest.raises(ValueError, match="0-dim"):
        quantize_mx(torch.tensor(1.0), block_size=1)
    with pytest.raises(TypeError):
        quantize_mx([1.0] * 32)
    mx = quantize_mx(torch.randn(2, 32))
    with pytest.raises(ValueError, match="floating"):
        dequantize_mx(mx, torch.int32)
    with pytest.raises(TypeError):
        dequantize_mx(torch.randn(2, 32))
    with pytest.raises(ValueError, match="not an FP8 format"):
        fp8_encode(torch.randn(4), "HIF8")
