"""Persistent host buffers for optimizer states, and moving one state between host and device.

A state is either a plain tensor or a DTensor (FSDP2 parameters are DTensors, so
their optimizer states are too); only the local tensor is ever copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from fsdp_turbo.core.device import pinned_empty
from fsdp_turbo.core.model_inspect import is_dtensor, local_tensor


def swappable(value: object, device_type: str) -> bool:
    """Dense, non-empty, non-scalar plain or DTensor state tensors on the compute device.

    Scalars (Adam's ``step``) stay where the optimizer keeps them: swapping them saves
    nothing and costs a copy each. Tensors that require grad belong to a
    differentiable optimizer's graph and are left alone.
    """
    if not isinstance(value, torch.Tensor) or value.requires_grad:
        return False
    local = local_tensor(value, differentiable=False)
    # Other tensor subclasses (quantized optimizer states, ...) may not survive a plain copy.
    return (type(local) is torch.Tensor and local.layout == torch.strided and local.dim() > 0 and local.numel() > 0
            and local.device.type == device_type)


def _dtensor_layout(value: torch.Tensor) -> tuple:
    return value.device_mesh, tuple(value.placements), tuple(value.shape), tuple(value.stride())


def _dense_stride(local: torch.Tensor) -> tuple[int, ...]:
    # The layout empty_like(preserve_format) would give: the original's if it is dense
    # and non-overlapping, else contiguous. A meta tensor allocates nothing.
    return tuple(torch.empty_like(local, device="meta").stride())


@dataclass(eq=False)
class HostSlot:
    """One state tensor's host home, reused every step so nothing is re-allocated.

    ``host_value`` is what the optimizer's state holds between steps: the host buffer
    itself, or a DTensor around it with the original mesh and placements.
    """

    host_local: torch.Tensor
    host_value: torch.Tensor
    device: torch.device
    stride: tuple[int, ...]

    @classmethod
    def for_value(cls, value: torch.Tensor, device_type: str) -> HostSlot:
        local = local_tensor(value, differentiable=False)
        host_local = pinned_empty(local.shape, local.dtype, device_type)
        host_value = host_local
        if is_dtensor(value):
            # from_local would move a host tensor back onto the mesh's device; the
            # constructor keeps it on the host, as FSDP2's CPU offload does.
            host_value = DTensor(host_local, value._spec, requires_grad=False)
        return cls(host_local, host_value, local.device, _dense_stride(local))

    def remember(self, local: torch.Tensor) -> None:
        """Come back to the device and layout the state had when it was last copied out."""
        self.device, self.stride = local.device, _dense_stride(local)

    def fits(self, value: torch.Tensor) -> bool:
        local = local_tensor(value, differentiable=False)
        if (local.shape, local.dtype) != (self.host_local.shape, self.host_local.dtype):
            return False
        if is_dtensor(value) != is_dtensor(self.host_value):
            return False
        return not is_dtensor(value) or _dtensor_layout(value) == _dtensor_layout(self.host_value)

    def to_device(self, *, non_blocking: bool) -> torch.Tensor:
        """A fresh device copy (same layout as the original) wrapped like the original."""
        local = torch.empty_strided(self.host_local.shape, self.stride, dtype=self.host_local.dtype,
                                    device=self.device)
        local.copy_(self.host_local, non_blocking=non_blocking)
        if not is_dtensor(self.host_value):
            return local
        host = self.host_value
        with torch.no_grad():
            return DTensor.from_local(local, host.device_mesh, host.placements, run_check=False,
                                      shape=host.shape, stride=host.stride())
