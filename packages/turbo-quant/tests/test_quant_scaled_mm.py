"""The ``torch._scaled_mm`` MX path of ``mx.linear``, checked on CPU (no compute-capability-10 GPU here):

- ``to_blocked_scales`` against cuBLAS's layout written as an index formula;
- the support decision;
- every GEMM's operands through torch's own ``_scaled_mm`` checks, on meta tensors;
- forward, dgrad and wgrad against the emulated path, with a stand-in ``_scaled_mm`` that
  un-blocks the scales by the index formula, dequantizes and multiplies in fp32.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_turbo.quantization.mx_formats import MXTensor, dequantize_mx
from fsdp_turbo.quantization.ops import scaled_mm_mx
from fsdp_turbo.quantization.ops.scaled_mm_mx import (
    block_scaled_mm,
    mx_linear_cuda,
    mx_linear_scaled_mm,
    scaled_mm_unsupported,
    to_blocked_scales,
)
from fsdp_turbo.quantization.training import MXRecipe
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear_emulated


def blocked_offset(r: int, c: int, cols: int) -> int:
    """cuBLAS 1-D block-scaling layout: 128 x 4 tiles, row-tile-major; inside a tile, the scale of
    (r, c) is at (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("shape", [(128, 4), (1, 1), (37, 3), (200, 7), (256, 12), (130, 5)])
def test_to_blocked_scales_puts_every_scale_where_the_index_formula_says(shape):
    rows, cols = shape
    scales = torch.randint(0, 255, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    blocked = to_blocked_scales(scales)
    assert blocked.dtype == torch.float8_e8m0fnu and blocked.is_contiguous() and blocked.dim() == 1
    assert blocked.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    flat = blocked.view(torch.uint8)
    expected = torch.zeros_like(flat)  # padding is 0x00
    for r in range(rows):
        for c in range(cols):
            expected[blocked_offset(r, c, cols)] = scales[r, c]
    assert torch.equal(flat, expected)


def test_to_blocked_scales_takes_e8m0_and_refuses_other_ranks():
    scales = torch.arange(8, dtype=torch.uint8).view(2, 4)
    assert torch.equal(to_blocked_scales(scales.view(torch.float8_e8m0fnu)).view(torch.uint8),
                       to_blocked_scales(scales).view(torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        to_blocked_scales(scales.view(-1))


def _why(**overrides):
    args = {"quant_format": "E4M3", "block_size": 32, "in_features": 64, "out_features": 96,
            "capability": (10, 0)}
    return scaled_mm_unsupported(**{**args, **overrides})


def test_the_decision_takes_scaled_mm_only_where_cublas_has_mx():
    assert _why() is None
    assert _why(quant_format="E5M2", capability=(12, 0)) is None
    assert "CUDA" in _why(capability=None)
    assert "9.0" in _why(capability=(9, 0))  # H100 / H200: no MX GEMM
    assert "ROCm" in _why(rocm=True)
    assert "HIF8" in _why(quant_format="HIF8")
    assert "1x32" in _why(block_size=16)
    assert "multiples of 32" in _why(in_features=48)
    assert "multiples of 32" in _why(out_features=80)
    assert "_scaled_mm" in _why(has_scaled_mm=False)


def _meta_mx(rows: int, k: int, fmt: str = "E4M3") -> MXTensor:
    dtype = torch.float8_e4m3fn if fmt == "E4M3" else torch.float8_e5m2
    data = torch.empty(rows, k, dtype=dtype, device="meta")
    scale = torch.empty(rows, k // 32, dtype=torch.uint8, device="meta")
    return MXTensor(data, scale, fmt, 32, 1, "floor", 8, torch.bfloat16, data.shape)


@pytest.mark.parametrize("tokens", [37, 128, 300])
def test_every_gemm_passes_torch_scaled_mm_checks_on_meta_tensors(tokens):
    # torch's meta kernel for _scaled_mm mirrors the CUDA checks: row-major a, column-major b,
    # dims multiple of 16, e8m0 scales of exactly ceil(rows/128)*128 * ceil(k/32/4)*4 bytes.
    k, n, padded = 64, 96, -(-tokens // 32) * 32
    for a, b, shape in (((tokens, k), (n, k), (tokens, n)),  # forward
                        ((tokens, n), (k, n), (tokens, k)),  # dgrad
                        ((n, padded), (k, padded), (n, k))):  # wgrad
        out = block_scaled_mm(_meta_mx(*a), _meta_mx(*b, "E5M2"))
        assert out.shape == shape and out.dtype == torch.bfloat16
    bad = _meta_mx(tokens, k)  # scales for 128 rows too many: one tile too many
    bad = MXTensor(bad.data, torch.empty(tokens + 128, k // 32, dtype=torch.uint8, device="meta"), "E4M3", 32, 1,
                   "floor", 8, torch.bfloat16, bad.data.shape)
    with pytest.raises(RuntimeError, match="blockwise"):
        block_scaled_mm(bad, _meta_mx(n, k))


def _unblock(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    flat = blocked.view(torch.uint8)
    index = torch.tensor([[blocked_offset(r, c, cols) for c in range(cols)] for r in range(rows)])
    return flat[index]


def stand_in_scaled_mm(a, b, scale_a, scale_b, *, out_dtype):
    """What torch._scaled_mm computes for MX operands, on CPU: a [M, K] @ b [K, N] in fp32."""
    assert a.stride(1) == 1 and b.stride(0) == 1, "a row-major, b column-major"
    (m, k), n = a.shape, b.shape[1]

    def values(data: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
        fmt = "E4M3" if data.dtype == torch.float8_e4m3fn else "E5M2"
        unblocked = _unblock(scale, rows, k // 32)
        return dequantize_mx(MXTensor(data.contiguous(), unblocked, fmt, 32, 1, "floor", 8, torch.float32,
                                      data.shape), torch.float32)

    return (values(a, scale_a, m) @ values(b.t(), scale_b, n).t()).to(out_dtype)


@pytest.mark.parametrize("recipe", [MXRecipe("E4M3", 32, "floor"), MXRecipe("E5M2", 32, "rceil")],
                         ids=lambda r: r.quant_format)
def test_the_scaled_mm_gemms_match_the_emulated_path(monkeypatch, recipe):
    monkeypatch.setattr(scaled_mm_mx, "GEMM", stand_in_scaled_mm)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(45, 64, generator=g) * 3).bfloat16()
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    grad = torch.randn(45, 96, generator=g).bfloat16()
    outs = []
    for fn in (mx_linear_scaled_mm, mx_linear_emulated):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, recipe)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, wi.grad))
    for ours, emulated in zip(*outs, strict=True):
        assert ours.dtype == emulated.dtype == torch.bfloat16
        torch.testing.assert_close(ours, emulated, rtol=0, atol=0)


def test_mx_linear_cuda_falls_back_to_the_emulated_gemms_off_mx_hardware():
    recipe = MXRecipe("E4M3", 32, "floor")
    x, w = torch.randn(8, 64), torch.randn(32, 64)
    assert torch.equal(mx_linear_cuda(x, w, recipe), mx_linear_emulated(x, w, recipe))
