"""The NPU backend, checked on CPU against a stand-in ``torch_npu`` (no NPU here).

The stand-in implements ``npu_dynamic_mx_quant`` / ``npu_quant_matmul`` from the portable
kernels with the documented shapes (paired E8M0 scales, ``[M, K] x [K, N]`` with the weight
scale transposed). That checks the backend's glue (axes, transposes, scale layouts), not
the NPU's numerics.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from fsdp_turbo.quantization.mx_formats import MXTensor, dequantize_mx, quantize_mx
from fsdp_turbo.quantization.ops.npu_mx_layout import (
    npu_linear_unsupported,
    npu_quantize_unsupported,
    scales_from_pairs,
    scales_to_pairs,
)
from fsdp_turbo.quantization.training import MXRecipe
from fsdp_turbo.quantization.training.mx_linear_function import mx_linear_emulated

_FORMAT_OF = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2"}


@pytest.mark.parametrize(("shape", "axis"), [((4, 96), 1), ((4, 64), 1), ((96, 5), 0), ((2, 160, 3), 1)])
def test_paired_scales_round_trip(shape, axis):
    scale = torch.randint(0, 255, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pairs = scales_to_pairs(scale, axis)
    assert pairs.dim() == scale.dim() + 1 and pairs.shape[-1] == 2
    assert pairs.shape[axis] == -(-shape[axis] // 2)
    assert torch.equal(scales_from_pairs(pairs, axis, shape[axis]), scale)


def test_paired_scales_put_block_pairs_last():
    scale = torch.arange(6, dtype=torch.uint8).view(1, 6)
    assert scales_to_pairs(scale, 1).tolist() == [[[0, 1], [2, 3], [4, 5]]]


def test_npu_decisions():
    assert npu_quantize_unsupported("E4M3", 32, "floor", None, torch.bfloat16) is None
    assert npu_quantize_unsupported("E5M2", 32, "floor", 15, torch.float16) is None
    assert "HIF8" in npu_quantize_unsupported("HIF8", 32, "floor", None, torch.bfloat16)
    assert "FLOOR" in npu_quantize_unsupported("E4M3", 32, "rceil", None, torch.bfloat16)
    assert "emax" in npu_quantize_unsupported("E4M3", 32, "floor", 7, torch.bfloat16)
    assert "block_size" in npu_quantize_unsupported("E4M3", 16, "floor", None, torch.bfloat16)
    assert "dtype" in npu_quantize_unsupported("E4M3", 32, "floor", None, torch.float32)
    assert npu_linear_unsupported(MXRecipe("E4M3"), 64, 96, torch.bfloat16) is None
    assert "multiples" in npu_linear_unsupported(MXRecipe("E4M3"), 48, 96, torch.bfloat16)
    assert "HIF8" in npu_linear_unsupported(MXRecipe("HIF8", 32, "floor", None, 7), 64, 96, torch.bfloat16)


def _dynamic_mx_quant(x, *, axis=-1, round_mode="rint", dst_type=torch.float8_e4m3fn, block_size=32):
    assert round_mode == "rint" and block_size == 32
    mx = quantize_mx(x, _FORMAT_OF[dst_type], block_size, "floor", axis=axis)
    return mx.data, scales_to_pairs(mx.scale, axis).view(torch.float8_e8m0fnu)


def _quant_matmul(x1, x2, scale, *, pertoken_scale, output_dtype, scale_dtype, pertoken_scale_dtype, group_sizes):
    assert group_sizes == [1, 1, 32] and scale_dtype == pertoken_scale_dtype == torch.float8_e8m0fnu
    (m, k), n = x1.shape, x2.shape[1]

    def values(data, pairs, rows):
        scale = scales_from_pairs(pairs, 1, k // 32)
        assert scale.shape == (rows, k // 32)
        fmt = _FORMAT_OF[data.dtype]
        return dequantize_mx(MXTensor(data.contiguous(), scale, fmt, 32, 1, "floor", 8, torch.float32,
                                      data.shape), torch.float32)

    # x2 is [K, N] (the weight's .t()), its scale [K/64, N, 2] (the weight's scale transposed).
    return (values(x1, pertoken_scale, m) @ values(x2.t(), scale.transpose(0, 1), n).t()).to(output_dtype)


@pytest.fixture
def npu_mx(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.npu_dynamic_mx_quant = _dynamic_mx_quant
    fake.npu_quant_matmul = _quant_matmul
    fake.float8_e8m0fnu = torch.float8_e8m0fnu
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.delitem(sys.modules, "fsdp_turbo.quantization.ops.npu_mx", raising=False)
    module = importlib.import_module("fsdp_turbo.quantization.ops.npu_mx")
    yield module
    sys.modules.pop("fsdp_turbo.quantization.ops.npu_mx", None)


@pytest.mark.parametrize("axis", [0, 1])
def test_npu_quantize_returns_mx_tensor_layout(npu_mx, axis):
    x = (torch.randn(64, 96) * 4).bfloat16()
    data, scale = npu_mx.quantize_mx_npu(x, "E4M3", 32, "floor", axis, 8)
    ref = quantize_mx(x, "E4M3", 32, "floor", axis=axis)
    assert data.dtype == torch.float8_e4m3fn and torch.equal(data.view(torch.uint8), ref.codes)
    assert torch.equal(scale, ref.scale)
    # Unsupported combinations run the portable kernel.
    data, scale = npu_mx.quantize_mx_npu(x, "HIF8", 32, "rceil", axis, 3)
    ref = quantize_mx(x, "HIF8", 32, "rceil", axis=axis)
    assert torch.equal(data, ref.codes) and torch.equal(scale, ref.scale)


@pytest.mark.parametrize("recipe", [MXRecipe("E4M3"), MXRecipe("E5M2"), MXRecipe("E4M3", 32, "rceil")],
                         ids=["E4M3", "E5M2", "rceil-emulated"])
def test_npu_linear_matches_the_emulated_path(npu_mx, recipe):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(45, 64, generator=g) * 3).bfloat16()
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    grad = torch.randn(45, 96, generator=g).bfloat16()
    outs = []
    for fn in (npu_mx.mx_linear_npu, mx_linear_emulated):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, recipe)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, wi.grad))
    for ours, emulated in zip(*outs, strict=True):
        torch.testing.assert_close(ours, emulated, rtol=0, atol=0)
