"""Device backends of the expert-parallel ops, registered lazily in turbo-core's op registry.

- ``npu_mc2``: ``ep.mc2`` on Ascend NPUs through torch_npu's fused MoE dispatch / combine
  kernels (when torch_npu can be found). Nothing is imported until the first call.
"""

from __future__ import annotations

from fsdp_turbo.core.ops import register_lazy_kernels

BACKENDS: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("ep.mc2", "npu", f"{__name__}.npu_mc2", "mc2_npu", "torch_npu"),
)


def register_backends() -> dict[tuple[str, str], str]:
    return register_lazy_kernels(BACKENDS)
