"""What must never be swapped, and which modules another technique already owns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

RECOMPUTE_MARK = "_fsdp_turbo_recompute"

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


def is_recomputed(module: nn.Module) -> bool:
    """Whether activation checkpointing owns this module's saved tensors.

    Composable ``checkpoint`` pushes its own saved-tensor hooks in a forward pre-hook;
    FSDPTurbo's recompute transform also marks the modules it wraps.
    """
    if getattr(module, RECOMPUTE_MARK, False):
        return True
    try:
        from torch.distributed._composable import checkpoint
    except ImportError:
        return False
    get_state = getattr(checkpoint, "state", None)
    state = get_state(module) if get_state is not None else None
    return state is not None and bool(getattr(state, "enable_hook", False))
