"""One module's saved tensors from one forward: the group, its entries and the pack handles.

The autograd graph holds the handles, the handles hold the entries, and each entry
holds its group. Nothing global refers to an entry, so several forwards can be in
flight (gradient accumulation) and an entry dies with the last node that saved it.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any

import torch

from fsdp_turbo.memory.swap_activation.mover import is_dense

if TYPE_CHECKING:
    from fsdp_turbo.memory.swap_activation.mover import Mover


class State(enum.Enum):
    OPEN = "open"  # the module's forward may still save tensors
    RESIDENT = "resident"  # closed and kept on device (the last module of a forward)
    OFFLOADING = "offloading"  # copy-out issued; device tensors still referenced
    OFFLOADED = "offloaded"  # on host only, until a prefetch or unpack brings them back
    LOADED = "loaded"  # backward reached it; entries hold device tensors again


class Entry:
    """One distinct saved view: its device tensor and/or host copy."""

    __slots__ = ("__weakref__", "dense", "device", "group", "host", "nbytes")

    def __init__(self, group: SwapGroup, tensor: torch.Tensor) -> None:
        self.group = group
        self.device: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        # Dense layouts (incl. transposes) keep their strides; gapped views come back contiguous.
        self.dense = is_dense(tensor.size(), tensor.stride())
        self.nbytes = tensor.numel() * tensor.element_size()


class Handle:
    """What autograd stores instead of a swapped tensor."""

    __slots__ = ("entry",)

    def __init__(self, entry: Entry) -> None:
        self.entry = entry


class DTensorHandle(Handle):
    """A swapped DTensor: its local tensor, plus what ``DTensor.from_local`` needs to rebuild it."""

    __slots__ = ("mesh", "placements", "shape", "stride")

    def __init__(self, entry: Entry, mesh: Any, placements: Any, shape: torch.Size, stride: tuple[int, ...]) -> None:
        super().__init__(entry)
        self.mesh = mesh
        self.placements = placements
        self.shape = shape
        self.stride = stride


def storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    # Storage plus view geometry: two views of one storage are two entries, the same view saved
    # twice is one. Safe while the group holds the entry, as it pins the storage.
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.size()),
            tuple(tensor.stride()), tensor.dtype)


class SwapGroup:
    """The saved tensors of module ``index`` from one forward."""

    def __init__(self, index: int, prev: SwapGroup | None, mover: Mover) -> None:
        self.index = index
        # The module that ran just before this one in the same forward: prefetched when this
        # group is first unpacked, since backward visits it next.
        self.prev = prev
        self.mover = mover
        self.state = State.OPEN
        # Weak values: an entry autograd has dropped needs no copy, and its key may be reused.
        self._entries: weakref.WeakValueDictionary[tuple[Any, ...], Entry] = weakref.WeakValueDictionary()
        self._pending: list[Entry] | None = None
        self._out_event: torch.Event | None = None
        self._in_events: list[torch.Event] = []
        self._unpacked = False

    def add(self, tensor: torch.Tensor) -> Entry:
        key = storage_key(tensor)
        with self.mover.lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = Entry(self, tensor.detach())
                self._entries[key] = entry
                self.mover.stats.tensors_packed += 1
            return entry

    def close(self, *, offload: bool) -> None:
        """End of this module's forward: start the copy-out, or keep the group on device."""
        with self.mover.lock:
            if self.state is not State.OPEN:
                return
            entries = [e for e in self._entries.values() if e.device is not None]
            if not offload or not entries:
                self.state = State.RESIDENT
                return
            # Strong references keep the device tensors alive until the copy is known done.
            self._pending = entries
            self._out_event = self.mover.copy_out(entries)
            self.state = State.OFFLOADING
            stats = self.mover.stats
            stats.out_by_module[self.index] = stats.out_by_module.get(self.index, 0) + len(entries)
            if self._out_event is None:
                self.release()

    def release(self) -> None:
        """Drop the device copies once the copy-out is ordered before any reuse of their memory."""
        with self.mover.lock:
            if self.state is not State.OFFLOADING:
                return
            self.mover.wait(self._out_event)
            for entry in self._pending or ():
                entry.device = None
            self._pending = None
            self._out_event = None
            self.state = State.OFFLOADED

    def _load(self) -> None:
        entries = [e for e in self._entries.values() if e.device is None and e.host is not None]
        if entries:
            event = self.mover.copy_in(entries)
            if event is not None:
                self._in_events.append(event)

    def prefetch(self) -> None:
        """Start bringing this group back to the device, unless it is already there."""
        with self.mover.lock:
            if self.state is State.OFFLOADED:
                self._load()
                self.state = State.LOADED
                self.mover.stats.prefetches += 1

    def fetch(self, entry: Entry) -> torch.Tensor:
        """The device tensor of ``entry``, for autograd's unpack."""
        with self.mover.lock:
            if not self._unpacked:
                self._unpacked = True
                self._first_unpack()
            if entry.device is None:  # dropped by an earlier copy-out and missed by the load
                self.mover.stats.sync_loads += 1
                event = self.mover.copy_in([entry])
                if event is not None:
                    self._in_events.append(event)
            for event in self._in_events:
                self.mover.wait(event)
            self._in_events.clear()
            return entry.device

    def _first_unpack(self) -> None:
        if self.state is State.OFFLOADING:
            # Backward came before the release: use the device tensors still here, but order
            # the copy-out before their memory can be reused.
            self.mover.wait(self._out_event)
            self._pending = None
            self._out_event = None
            self.state = State.LOADED
        elif self.state is State.OFFLOADED:
            self.mover.stats.sync_loads += 1
            self._load()
            self.state = State.LOADED
        prev, self.prev = self.prev, None
        if prev is not None:
            prev.prefetch()


def unpack(packed: Any) -> torch.Tensor:
    """The unpack hook: raw tensors were never swapped; handles are fetched back."""
    if not isinstance(packed, Handle):
        return packed
    local = packed.entry.group.fetch(packed.entry)
    if isinstance(packed, DTensorHandle):
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(local, packed.mesh, packed.placements, run_check=False,
                                      shape=packed.shape, stride=packed.stride)
    return local
