"""Bit-exactness of the Triton kernels against the portable ones, run under Triton's interpreter,
and their ahead-of-time compilation for NVIDIA targets (no GPU needed: Triton ships ptxas).

Run by ``test_quant_triton.py`` in subprocesses, so ``TRITON_INTERPRET=1`` is set before triton
is imported and the test process stays clean. Each prints one JSON object.

    TRITON_INTERPRET=1 python packages/turbo-quant/tests/quant_triton_cases.py   # bit-exactness
    python packages/turbo-quant/tests/quant_triton_cases.py --compile            # sm_90 / sm_100 PTX
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys

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


def compile_all() -> dict[str, object]:
    """Compile the kernels to PTX and cubin for sm_90 and sm_100; report what the PTX holds.

    The encoding is meant to be integer-only: no ``.ftz`` float op and no ``fma`` (contraction)
    may appear, so the codes cannot depend on the GPU's float modes.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fsdp_turbo.quantization.ops import triton_mx

    pointer = {"bf16": "*i16", "fp16": "*fp16", "fp32": "*fp32"}
    compiled: dict[str, dict[str, int]] = {}

    def build(name: str, kernel, arrays: dict[str, str], scalars: tuple[str, ...], consts: dict, arch: int) -> None:
        signature = {**arrays, **dict.fromkeys(scalars, "i32"), **dict.fromkeys(consts, "constexpr")}
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
        binary = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        ptx = binary.asm["ptx"]
        compiled[name] = {"cubin_bytes": len(binary.asm["cubin"]), "ftz": len(re.findall(r"\.ftz\b", ptx)),
                          "fma": len(re.findall(r"\bfma\.", ptx))}

    cases = [("E4M3", "bf16", 1), ("E5M2", "fp16", 1), ("HIF8", "fp32", 1), ("E4M3", "bf16", 4096)]
    for (fmt, dname, post), arch in itertools.product(cases, (90, 100)):
        rows_t, block_p2, post_t = triton_mx.tile_shape(32, post)
        consts = {"BLOCK": 32, "BLOCK_P2": block_p2, "ROWS_T": rows_t, "POST_T": post_t, "BF16": dname == "bf16",
                  **triton_mx._format_constants(get_format(fmt), "rceil", get_format(fmt).emax_elem)}
        arrays = {"x_ptr": pointer[dname], "codes_ptr": "*u8", "scale_ptr": "*u8", "table_ptr": "*u8"}
        build(f"mx.quantize/{fmt}/{dname}/post{post}/sm{arch}", triton_mx._mx_quantize_kernel, arrays,
              ("rows", "post"), consts, arch)
    for dname in ("bf16", "fp32"):
        consts = {"TILE": triton_mx.TILE_ELEMS, "BF16": dname == "bf16", "NAN_CODE": 0x80}
        build(f"hif8.encode/{dname}/sm100", triton_mx._hif8_encode_kernel,
              {"x_ptr": pointer[dname], "codes_ptr": "*u8", "table_ptr": "*u8"}, ("n",), consts, 100)
    return {"compiled": compiled}


if __name__ == "__main__":
    if "--compile" in sys.argv:
        print(json.dumps(compile_all()))
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (these checks run Triton on CPU tensors), or pass --compile")
    else:
        print(json.dumps(run_all()))
