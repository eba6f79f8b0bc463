"""Host <-> device copies for swapped activations, on side streams where the device has them.

On CPU (forced mode) every copy is synchronous and there are no streams or events.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from fsdp_turbo.core.device import current_device, new_stream, pinned_empty, stream_context

if TYPE_CHECKING:
    from collections.abc import Sequence


class Entry(Protocol):
    """One saved tensor as the mover sees it (``group.Entry``)."""

    device: torch.Tensor | None
    host: torch.Tensor | None
    dense: bool  # keeps its strides through the host copy
    nbytes: int


@dataclass
class SwapStats:
    """Counters for tests and logs; they only ever grow (call ``reset`` between checks)."""

    tensors_packed: int = 0
    tensors_out: int = 0
    bytes_out: int = 0
    tensors_in: int = 0
    bytes_in: int = 0
    prefetches: int = 0
    sync_loads: int = 0
    out_by_module: dict[int, int] = field(default_factory=dict)

    def reset(self) -> None:
        fresh = SwapStats()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))


def is_dense(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether the layout covers exactly ``numel`` elements with no gaps or overlaps (any dim order)."""
    expected = 1
    for length, step in sorted(zip(size, stride), key=lambda pair: pair[1]):
        if length == 1:
            continue
        if step != expected:
            return False
        expected *= length
    return True


class Mover:
    """Issues the copies for all groups of one swapper; the lock guards group state across threads
    (the autograd engine unpacks on its own device threads)."""

    def __init__(self, device_type: str, stats: SwapStats) -> None:
        self.device_type = device_type
        self.stats = stats
        self.lock = threading.RLock()
        self._device: torch.device | None = None
        self._out: torch.Stream | None = None
        self._in: torch.Stream | None = None

    def _streams(self) -> tuple[torch.Stream | None, torch.Stream | None]:
        # Lazily, so building a swapper never touches the device.
        if self._device is None:
            self._device = current_device(self.device_type)
            # Two streams: device-to-host and host-to-device copies can run on separate engines.
            self._out = new_stream(self.device_type)
            self._in = new_stream(self.device_type)
        return self._out, self._in

    def _compute(self) -> torch.Stream:
        return torch.accelerator.current_stream(self._device)

    def wait(self, event: torch.Event | None) -> None:
        """Make the compute stream wait for ``event`` (no host sync)."""
        if event is not None:
            self._compute().wait_event(event)

    def copy_out(self, entries: Sequence[Entry]) -> torch.Event | None:
        """Start copying each entry's device tensor into a fresh (pinned) host buffer."""
        out, _ = self._streams()
        with torch.no_grad():
            if out is not None:
                # The copies must see the finished activations.
                out.wait_stream(self._compute())
            with stream_context(out):
                for entry in entries:
                    device = entry.device
                    flat = pinned_empty((device.numel(),), device.dtype, self.device_type)
                    host = flat.as_strided(device.size(), device.stride()) if entry.dense else flat.view(device.size())
                    host.copy_(device, non_blocking=out is not None)
                    entry.host = host
                event = out.record_event() if out is not None else None
        self.stats.tensors_out += len(entries)
        self.stats.bytes_out += sum(entry.nbytes for entry in entries)
        return event

    def copy_in(self, entries: Sequence[Entry]) -> torch.Event | None:
        """Start copying each entry's host buffer into a new device tensor (same layout when dense)."""
        _, inbound = self._streams()
        with torch.no_grad():
            # Allocate on the compute stream, which owns (and later frees) these tensors.
            targets = [torch.empty_strided(e.host.size(), e.host.stride(), dtype=e.host.dtype, device=self._device)
                       for e in entries]
            if inbound is not None:
                # The memory may have just been freed by queued compute work.
                inbound.wait_event(self._compute().record_event())
            with stream_context(inbound):
                for entry, target in zip(entries, targets):
                    target.copy_(entry.host, non_blocking=inbound is not None)
                    if inbound is not None:
                        # A prefetched entry that autograd drops unread must not free memory
                        # the copy is still writing.
                        target.record_stream(inbound)
                event = inbound.record_event() if inbound is not None else None
        for entry, target in zip(entries, targets):
            entry.device = target
        self.stats.tensors_in += len(entries)
        self.stats.bytes_in += sum(entry.nbytes for entry in entries)
        return event
