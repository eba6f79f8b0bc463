"""Device backends of turbo-quant's ops, registered in turbo-core's op registry.

- ``triton_mx``: ``mx.quantize`` and ``hif8.encode`` for "cuda" as Triton kernels (when
  ``triton`` is installed);
- ``scaled_mm_mx``: ``mx.linear`` for "cuda" through ``torch._scaled_mm`` with MX block
  scales where the GPU has them (compute capability >= 10.0), else the emulated GEMMs;
- ``npu_mx``: ``mx.quantize`` and ``mx.linear`` for "npu" through torch_npu (when installed).

Registration is lazy (turbo-core's ``LazyKernel``): :func:`register_backends` only asks
whether ``triton`` / ``torch_npu`` can be found (no import) and registers stubs that import
their backend module on the first call. So importing turbo-quant never imports Triton or
torch_npu, never fails without them, and registers nothing for a device whose library is
missing. Backend modules are the only place in turbo-quant that imports ``triton``,
``torch_npu`` or calls ``torch.cuda``.
"""

from __future__ import annotations

from fsdp_turbo.core.ops import LazyKernel, backend_of, register_lazy_kernels

__all__ = ["BACKENDS", "LazyKernel", "backend_of", "register_backends"]

# (op, device type, backend module, attribute, library the module needs or None).
BACKENDS: tuple[tuple[str, str, str, str, str | None], ...] = tuple(
    (op, device, f"{__name__}.{module}", attr, library) for op, device, module, attr, library in (
        ("mx.quantize", "cuda", "triton_mx", "quantize_mx_triton", "triton"),
        ("hif8.encode", "cuda", "triton_mx", "hif8_encode_triton", "triton"),
        ("mx.linear", "cuda", "scaled_mm_mx", "mx_linear_cuda", None),
        ("mx.quantize", "npu", "npu_mx", "quantize_mx_npu", "torch_npu"),
        ("mx.linear", "npu", "npu_mx", "mx_linear_npu", "torch_npu"),
    )
)


def register_backends() -> dict[tuple[str, str], str]:
    """Register the backends whose library can be found; returns {(op, device): module}."""
    return register_lazy_kernels(BACKENDS)
