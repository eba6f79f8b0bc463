"""What must never be swapped, and which modules another technique already owns."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fsdp_turbo.core.model_inspect import local_tensor


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
                found.add(local_tensor(tensor, differentiable=False).untyped_storage().data_ptr())
    return found
