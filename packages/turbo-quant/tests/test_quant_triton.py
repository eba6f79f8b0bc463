"""The Triton ``mx.quantize`` / ``hif8.encode`` kernels are bit-exact against the portable kernels.

They run on CPU under Triton's interpreter (``TRITON_INTERPRET=1``), in one subprocess so the
variable is set before triton is imported and this process stays clean. Skipped when triton
is not installed (``nox -s quant_triton`` installs it).
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


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_kernels_are_bit_exact_under_the_interpreter(interpreted):
    results = interpreted["mismatches"]
    # 36 special-value cases (3 formats x 2 modes x 2 block sizes x 3 dtypes), 6 all-bf16,
    # 6 fp32 bit-pattern, 6 axis / block / emax variants, 3 hif8.encode.
    assert len(results) == 57
    assert {name: n for name, n in results.items() if n} == {}
    assert interpreted["elements"] > 500_000


def test_importing_the_kernels_needs_no_gpu(interpreted):
    # The module imported, compiled and ran on CPU in the subprocess: no torch.cuda call at import.
    assert any(name.startswith("special/E4M3/floor/b32/bf16") for name in interpreted["mismatches"])
