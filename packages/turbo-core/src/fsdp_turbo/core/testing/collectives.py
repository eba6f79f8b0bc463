"""Bytes a rank moves in all-gathers, counted at ``torch.distributed``'s functions (for tests and
benchmarks that hold a layout to its communication)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# FSDP2 calls all_gather_single in newer torch, all_gather_into_tensor in older; list gathers too.
_ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")


class AllGatherBytes:
    """While active, ``received`` counts the bytes this rank receives from all-gathers: each
    call's input from every other rank of its group."""

    def __init__(self) -> None:
        self.received = 0
        self._originals = {name: getattr(dist, name) for name in _ALL_GATHERS if hasattr(dist, name)}

    def __enter__(self) -> AllGatherBytes:
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(original))
        return self

    def _counted(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(output, input, group=None, **kwargs):
            self.received += input.numel() * input.element_size() * (dist.get_world_size(group) - 1)
            return original(output, input, group=group, **kwargs)
        return collective

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
