"""DTensor facts the swaps need: whether a tensor is one, and the local tensor holding its data."""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(value: object) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (read directly: no autograd record), else the tensor itself."""
    return value._local_tensor if is_dtensor(value) else value
