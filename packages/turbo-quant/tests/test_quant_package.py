"""turbo-quant's packaging: version, namespace layout and the dependency rule."""

from pathlib import Path

import fsdp_turbo.quantization
from fsdp_turbo.core.testing.imports import SHARED_ALLOWED, feature_package_problems, foreign_imports

# Device backends (ops/) may also import their device's library, lazily loaded (see ops/__init__).
BACKEND_LIBRARIES = ("triton", "torch_npu")
OPS = Path(fsdp_turbo.quantization.__file__).resolve().parent / "ops"


def test_packaging_rules():
    problems = feature_package_problems("turbo-quant", "fsdp_turbo.quantization")
    assert [p for p in problems if not p.startswith(f"{OPS}/")] == []


def test_only_the_backends_import_device_libraries():
    allowed = (*SHARED_ALLOWED, "fsdp_turbo.quantization", *BACKEND_LIBRARIES)
    assert foreign_imports(OPS, allowed) == {}
    importers = {Path(path).name for path, names in foreign_imports(OPS, (*SHARED_ALLOWED, "fsdp_turbo")).items()}
    assert importers == {"triton_mx.py", "npu_mx.py"}
