"""Bit-exactness of the Triton kernels against the portable ones, run under Triton's interpreter.

Run by ``test_quant_triton.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the variable must
be set before triton is imported, and the test process stays clean). Prints one JSON object:
case name -> number of mismatched bytes (codes + scales), plus element counts.

    TRITON_INTERPRET=1 python packages/turbo-quant/tests/quant_triton_cases.py
"""

from __future__ import annotations

import itertools
import json
import os

import torch

from fsdp_turbo.core.ops import PORTABLE, get_op
from fsdp_turbo.quantization.mx_formats import get_format

FORMATS = ("E4M3", "E5M2", "HIF8")
MODES = ("floor", "rceil")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def special_values(block: int) -> torch.Tensor:
    """Rows of ``4 * block`` fp32 values; every block of a row is one situation of the policy."""
    g = torch.Generator().manual_seed(block)
    tiny = 2.0**-126
    rows = []

    def row(*blocks: torch.Tensor) -> None:
        rows.append(torch.cat([b.float().reshape(-1) for b in blocks]))

    full = torch.full((block,), 1.0)
    wide = torch.randn(block, generator=g) * torch.logspace(-6, 6, block)
    row(torch.zeros(block), -torch.zeros(block), wide, wide * 2.0**-100)
    row(full.index_fill(0, torch.tensor([3]), float("inf")), full.index_fill(0, torch.tensor([1]), -float("inf")),
        full.index_fill(0, torch.tensor([5]), float("nan")), torch.full((block,), float("nan")))
    # amax below the smallest normal (subnormals, all-subnormal blocks), and mixed with normals.
    subnormals = torch.randint(1, 1 << 23, (block,), generator=g, dtype=torch.int32).view(torch.float32)
    row(subnormals, -subnormals, subnormals.index_fill(0, torch.tensor([0]), tiny), subnormals * 0 + tiny / 2)
    # Ties and boundaries of the element formats after scaling by 1 (amax pinned by one element).
    ties = torch.tensor([0.0, 1.0625, 1.1875, 17.0, 19.0, 0.5 * 2**-9, 1.5 * 2**-9, 2.5 * 2**-9, 464.0,
                         480.0, 2.0**-7 * 1.0625, 9.5, 11.5, 2.0**-16 * 0.5, 3 * 2.0**-17, 57344.0 * 1.0625])
    pinned = torch.cat([torch.tensor([256.0]), ties.repeat(block)[: block - 1]])
    row(pinned, -pinned, pinned * 2.0**-60, pinned * 2.0**60)
    # Blocks whose scaled max lands above max_elem (FLOOR clamps), and powers of two at the edges.
    row(torch.full((block,), 500.0), torch.full((block,), 65000.0), torch.full((block,), 2.0**127),
        torch.full((block,), 3.0e38))
    return torch.stack(rows)


def all_bf16() -> torch.Tensor:
    """Every bf16 bit pattern, shuffled into rows of 64 (so blocks mix magnitudes)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    order = torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))
    return bits[order].view(torch.bfloat16).reshape(-1, 64)


def mismatches(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> int:
    codes = int((a[0].view(torch.uint8) != b[0].view(torch.uint8)).sum())
    return codes + int((a[1] != b[1]).sum()) + int(a[0].dtype != b[0].dtype) + int(a[1].shape != b[1].shape)


def run_all() -> dict[str, object]:
    from fsdp_turbo.quantization.ops.triton_mx import hif8_encode_triton, quantize_mx_triton

    portable = get_op("mx.quantize", PORTABLE)
    results: dict[str, int] = {}
    elements = 0

    def check(name: str, x: torch.Tensor, fmt: str, block: int, mode: str, axis: int, emax: int) -> None:
        nonlocal elements
        args = (fmt, block, mode, axis, emax)
        results[name] = mismatches(quantize_mx_triton(x, *args), portable(x, *args))
        elements += x.numel()

    # Formats x scale modes x block sizes 16 / 32 x dtypes, on the special-value rows.
    for fmt, mode, block, (dname, dtype) in itertools.product(FORMATS, MODES, (16, 32), DTYPES.items()):
        x = special_values(block).to(dtype)
        check(f"special/{fmt}/{mode}/b{block}/{dname}", x, fmt, block, mode, -1 % x.dim(), get_format(fmt).emax_elem)
    # Every bf16 pattern, both modes, each format.
    for fmt, mode in itertools.product(FORMATS, MODES):
        check(f"all-bf16/{fmt}/{mode}", all_bf16(), fmt, 32, mode, 1, get_format(fmt).emax_elem)
    # Random fp32 bit patterns (NaN, Inf and subnormals included), along a non-last axis too.
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(-(2**31), 2**31 - 1, (64, 96), generator=g, dtype=torch.int32).view(torch.float32)
    for fmt, axis in itertools.product(FORMATS, (0, 1)):
        check(f"fp32-bits/{fmt}/axis{axis}", raw, fmt, 32, "rceil", axis, get_format(fmt).emax_elem)
    # Blocks along the middle axis of a 3-D tensor, a block size that is not a power of two,
    # and non-default emax (HIF8's gradient target, FLOOR and RCEIL).
    wide = torch.randn(4, 48, 24, generator=g) * torch.logspace(-8, 8, 24)
    check("axis1-3d/E4M3/floor/b16", wide.bfloat16(), "E4M3", 16, "floor", 1, 8)
    check("block24/E5M2/rceil", wide, "E5M2", 24, "rceil", 2, 15)
    for mode in MODES:
        check(f"emax7/HIF8/{mode}", wide, "HIF8", 16, mode, 1, 7)
        check(f"emax0/E4M3/{mode}", special_values(24), "E4M3", 24, mode, 1, 0)  # RCEIL: tiny-amax policy

    # hif8.encode: every bf16 pattern, random fp32 bits, fp16.
    hif8 = get_op("hif8.encode", PORTABLE)
    for name, x in (("all-bf16", all_bf16()), ("fp32-bits", raw), ("fp16", wide.half())):
        results[f"hif8.encode/{name}"] = int((hif8_encode_triton(x) != hif8(x)).sum())
        elements += x.numel()
    return {"mismatches": results, "elements": elements}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (these checks run Triton on CPU tensors)")
    print(json.dumps(run_all()))
