"""What must never be swapped, and which modules another technique already owns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no autograd record), else the tensor itself."""
    if is_dtensor(tensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def state_holders(module: nn.Module) -> list[nn.Module]:
    """Submodules with their own parameters or buffers (the structure, not the tensors, which
    FSDP2 swaps in and out of ``_parameters`` around every forward)."""
    return [sub for sub in module.modules() if sub._parameters or sub._buffers]


def state_storages(holders: Sequence[nn.Module]) -> set[int]:
    """Storage addresses of the holders' parameters and buffers as they are right now.

    Called at pack time, i.e. inside the forward, when FSDP2 has all-gathered the
    parameters: views of the unsharded parameters (``weight.t()`` saved by addmm)
    share these storages and must stay where FSDP2 manages them.
    """
    found: set[int] = set()
    for holder in holders:
        for tensor in (*holder._parameters.values(), *holder._buffers.values()):
            if tensor is not None:
                found.add(local_tensor(tensor).untyped_storage().data_ptr())
    return found
