"""The Triton ``mx.quantize`` / ``hif8.encode`` kernels are bit-exact against the portable kernels
under Triton's CPU interpreter (``TRITON_INTERPRET=1``), and compile for sm_90 / sm_100 with
integer-only encoding (no ``.ftz``, no ``fma`` in the PTX).

Both run in subprocesses (``quant_triton_cases.py``), so the variable is set before triton is
imported and this process stays clean. Skipped when triton is not installed (``nox -s
quant_triton`` installs it). No GPU runs here: that the compiled kernels also agree on a GPU
is ``tools/gpu_check``'s check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CASES = Path(__file__).with_name("quant_triton_cases.py")


def _run_cases(*args: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    done = subprocess.run([sys.executable, str(CASES), *args], env=environ, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _run_cases(TRITON_INTERPRET="1")


def test_triton_kernels_are_bit_exact_under_the_interpreter(interpreted):
    results = interpreted["mismatches"]
    # 36 special-value cases (3 formats x 2 modes x 2 block sizes x 3 dtypes), 6 all-bf16,
    # 6 fp32 bit-pattern, 6 axis / block / emax variants, 3 hif8.encode.
    assert len(results) == 57
    assert {name: n for name, n in results.items() if n} == {}
    assert interpreted["elements"] > 500_000


def test_the_kernels_compile_for_hopper_and_blackwell_with_integer_only_encoding():
    compiled = _run_cases("--compile", TRITON_DEFAULT_FP_FUSION="1")["compiled"]
    assert len(compiled) == 10
    for name, facts in compiled.items():
        assert facts["cubin_bytes"] > 0, name
        assert facts["ftz"] == 0 and facts["fma"] == 0, (name, facts)
