"""Device backends of turbo-quant's ops, registered in turbo-core's op registry.

- ``triton_mx``: ``mx.quantize`` and ``hif8.encode`` for "cuda" as Triton kernels (when
  ``triton`` is installed);
- ``scaled_mm_mx``: ``mx.linear`` for "cuda" through ``torch._scaled_mm`` with MX block
  scales where the GPU has them (compute capability >= 10.0), else the emulated GEMMs;
- ``npu_mx``: ``mx.quantize`` and ``mx.linear`` for "npu" through torch_npu (when installed).

Registration is lazy: :func:`register_backends` only asks whether ``triton`` / ``torch_npu``
can be found (no import) and registers stubs that import their backend module on the first
call. So importing turbo-quant never imports Triton or torch_npu, never fails without them,
and registers nothing for a device whose library is missing. Backend modules are the only
place in turbo-quant that imports ``triton``, ``torch_npu`` or calls ``torch.cuda``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.ops import PORTABLE, get_op, register_op

__all__ = ["BACKENDS", "LazyKernel", "backend_of", "register_backends"]

_log = get_logger(__name__)

# (op, device type, backend module, attribute, library the module needs or None).
BACKENDS: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("mx.quantize", "cuda", "triton_mx", "quantize_mx_triton", "triton"),
    ("hif8.encode", "cuda", "triton_mx", "hif8_encode_triton", "triton"),
    ("mx.linear", "cuda", "scaled_mm_mx", "mx_linear_cuda", None),
    ("mx.quantize", "npu", "npu_mx", "quantize_mx_npu", "torch_npu"),
    ("mx.linear", "npu", "npu_mx", "mx_linear_npu", "torch_npu"),
)


class LazyKernel:
    """An op kernel that imports its backend module on the first call.

    If that import fails (the library is present but broken), the op falls back to its
    portable kernel with a one-time warning instead of failing every call.
    """

    def __init__(self, op: str, module: str, attr: str) -> None:
        self.op, self.module, self.attr = op, module, attr
        self._fn: Callable[..., Any] | None = None

    @property
    def backend(self) -> str:
        return self.module

    def resolve(self) -> Callable[..., Any]:
        if self._fn is None:
            try:
                module = importlib.import_module(f"{__name__}.{self.module}")
                self._fn = getattr(module, self.attr)
            except ImportError as err:
                warn_once(_log, f"op {self.op!r}: backend {self.module} does not import ({err}); "
                                "using the portable kernel")
                self._fn = get_op(self.op, PORTABLE)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


def _available(library: str | None) -> bool:
    # find_spec looks the package up on sys.path without importing it (cheap, no side effects).
    return library is None or importlib.util.find_spec(library) is not None


def register_backends() -> dict[tuple[str, str], str]:
    """Register the backends whose library can be found; returns {(op, device): module}."""
    registered = {}
    for op, device, module, attr, library in BACKENDS:
        if _available(library):
            register_op(op, device, override=True)(LazyKernel(op, module, attr))
            registered[(op, device)] = module
    return registered


def backend_of(op: str, device_type: str) -> str:
    """Which implementation ``call_op(op, device_type)`` runs: a backend module name or 'portable'."""
    kernel = get_op(op, device_type)
    return kernel.backend if isinstance(kernel, LazyKernel) else PORTABLE
