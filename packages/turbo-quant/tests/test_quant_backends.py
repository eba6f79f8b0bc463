"""Device backends are registered lazily: importing turbo-quant imports no triton / torch_npu,
registers nothing for a device whose library is missing, and a broken backend falls back."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap

import torch

from fsdp_turbo.core.ops import PORTABLE, get_op
from fsdp_turbo.quantization.ops import BACKENDS, LazyKernel, backend_of


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_turbo_quant_imports_no_device_library_and_registers_only_what_is_installed():
    seen = _run("""
        import importlib.util, json, sys
        import torch
        import fsdp_turbo.quantization.converter, fsdp_turbo.quantization.training
        from fsdp_turbo.core.ops import registered_ops
        from fsdp_turbo.quantization.mx_formats import quantize_mx
        from fsdp_turbo.quantization.mx_formats.reference import quantize_mx_naive
        x = torch.randn(8, 64)
        mx = quantize_mx(x, "E4M3")
        codes, scale = quantize_mx_naive(x, "E4M3", 32, "floor")
        print(json.dumps({"modules": sorted(m for m in ("triton", "torch_npu") if m in sys.modules),
                          "ops": {k: list(v) for k, v in registered_ops().items()},
                          "cpu_ok": bool(torch.equal(mx.codes, codes) and torch.equal(mx.scale, scale))}))
    """)
    assert seen["modules"] == []
    assert seen["cpu_ok"]
    ops = seen["ops"]
    has_triton = importlib.util.find_spec("triton") is not None
    has_npu = importlib.util.find_spec("torch_npu") is not None
    assert ("cuda" in ops["mx.quantize"]) == has_triton
    assert ("cuda" in ops["hif8.encode"]) == has_triton
    assert "cuda" in ops["mx.linear"]  # torch._scaled_mm needs no extra library
    if not has_npu:
        assert [op for op, devices in ops.items() if "npu" in devices] == []


def test_a_found_torch_npu_registers_the_npu_kernels_without_importing_it():
    seen = _run("""
        import importlib.util, json, sys
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: object() if name == "torch_npu" else real(name, *a)
        import fsdp_turbo.quantization
        from fsdp_turbo.core.ops import registered_ops
        print(json.dumps({"ops": {k: list(v) for k, v in registered_ops().items()},
                          "imported": "torch_npu" in sys.modules}))
    """)
    assert not seen["imported"]
    assert "npu" in seen["ops"]["mx.quantize"] and "npu" in seen["ops"]["mx.linear"]


def test_backends_table_names_real_modules_and_functions():
    for op, _device, module, attr, library in BACKENDS:
        if library is None or importlib.util.find_spec(library) is not None:
            assert callable(getattr(importlib.import_module(module), attr)), op


def test_a_backend_that_does_not_import_falls_back_to_the_portable_kernel():
    kernel = LazyKernel("mx.quantize", "no_such_backend", "quantize")
    x = torch.randn(4, 32)
    data, scale = kernel(x, "E5M2", 32, "rceil", 1, 15)
    ref_data, ref_scale = get_op("mx.quantize", PORTABLE)(x, "E5M2", 32, "rceil", 1, 15)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert kernel.resolve() is get_op("mx.quantize", PORTABLE)
    assert kernel.backend == PORTABLE  # backend_of reports what ran, not what was registered


def test_backend_of_names_what_runs():
    assert backend_of("mx.quantize", "cpu") == PORTABLE
    assert backend_of("mx.linear", "cuda") == "scaled_mm_mx"
    expected = "triton_mx" if importlib.util.find_spec("triton") is not None else PORTABLE
    assert backend_of("mx.quantize", "cuda") == expected
