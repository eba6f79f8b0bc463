"""Optimizer states in (pinned) host memory between steps, swapped in group by group around ``step()``.

During a step, the first lookup of a parameter of group k (see ``state_map``) makes
group k resident, starts group k+1's host-to-device copy on a side stream, and,
for optimizers known to update group by group, starts copying the earlier groups
back out. The post-step hook copies out the rest and waits, so between steps every
swapped state is a host buffer and ``state_dict()`` sees host values.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_turbo.core.device import has_streams, new_stream, stream_context
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_inspect import local_tensor
from fsdp_turbo.memory.swap_optimizer.slots import HostSlot, swappable
from fsdp_turbo.memory.swap_optimizer.state_map import SwapStateMap

_log = get_logger(__name__)

SWAPPER_ATTR = "_fsdp_turbo_optimizer_swapper"
"""Where an optimizer keeps its swapper, so it never gets two."""


@dataclass
class SwapStats:
    """How often each param group's states were copied in and out, and how many bytes."""

    swap_ins: Counter[int] = field(default_factory=Counter)
    swap_outs: Counter[int] = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0


class _Streams:
    """The copy (side) stream and the compute stream it orders against.

    Without streams (CPU) every method is a no-op and copies are synchronous.
    """

    def __init__(self, device_type: str) -> None:
        self.side = new_stream(device_type)
        self.compute: torch.Stream | None = None

    @property
    def active(self) -> bool:
        return self.side is not None

    def bind_compute(self) -> None:
        # The stream step() runs on, read per step: the user may step inside a stream context.
        if self.side is not None:
            self.compute = torch.accelerator.current_stream(self.side.device)

    def copying(self) -> AbstractContextManager[None]:
        return stream_context(self.side)

    def copies_wait_for_compute(self) -> None:
        # A copy-out must not read a state before the compute stream has updated it.
        if self.side is not None:
            self.side.wait_stream(self.compute)

    def mark_copies(self) -> torch.Event | None:
        return self.side.record_event() if self.side is not None else None

    def compute_waits(self, event: torch.Event | None) -> None:
        if event is not None:
            self.compute.wait_event(event)

    def used_on_compute(self, tensor: torch.Tensor) -> None:
        # Allocated on the side stream, used on compute: the allocator must not reuse it early.
        if self.side is not None:
            tensor.record_stream(self.compute)

    def used_on_copies(self, tensor: torch.Tensor) -> None:
        # Read by a copy-out on the side stream after the state map has dropped it.
        if self.side is not None:
            tensor.record_stream(self.side)

    def synchronize(self) -> None:
        if self.side is not None:
            self.side.synchronize()


def _updates_group_by_group(optimizer: torch.optim.Optimizer) -> bool:
    """True for ``torch.optim`` steps, which finish each group before reading the next.

    Copying a group out before the step ends is only safe then; another optimizer
    might still write a state of a group it has already read.
    """
    return (getattr(type(optimizer).step, "__module__", None) or "").startswith("torch.optim.")


def device_type_of(optimizer: torch.optim.Optimizer) -> str:
    """The accelerator the optimizer's parameters live on, else ``"cpu"``."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            kind = local_tensor(param, differentiable=False).device.type
            if kind != "cpu":
                return kind
    return "cpu"


class OptimizerStateSwapper:
    """Keeps an optimizer's device states in host buffers between steps.

    Attach it with :func:`swap_optimizer_states`. It works through the optimizer's
    step hooks and its load-state-dict hook, so the training loop is unchanged.
    ``enabled`` is False on a device without streams unless ``force`` is set; then
    it does nothing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, device_type: str, force: bool = False,
                 early_copy_out: bool | None = None) -> None:
        self.device_type = device_type
        self.enabled = has_streams(device_type) or force
        self.early_copy_out = _updates_group_by_group(optimizer) if early_copy_out is None else early_copy_out
        self.stats = SwapStats()
        self._optimizer = weakref.ref(optimizer)
        self._handles: list[Any] = []
        self._slots: dict[torch.Tensor, dict[Hashable, HostSlot]] = {}
        self._groups: list[list[torch.Tensor]] = []
        self._group_of: dict[torch.Tensor, int] = {}
        self._pending: dict[int, tuple[torch.Event | None, list[tuple]]] = {}
        self._resident: set[int] = set()
        self._active: int | None = None
        self._in_step = False
        self._state: SwapStateMap | None = None
        if not self.enabled:
            _log.info(f"optimizer-state swap is off: device {device_type!r} has no streams "
                      "(force it with force=True / swap_force=True)")
            return
        self._streams = _Streams(device_type)
        self._wrap_state(optimizer)
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]
        setattr(optimizer, SWAPPER_ATTR, self)

    # ----- public -----------------------------------------------------------------------
    def offload(self) -> None:
        """Copy every device-resident state to its host buffer now (between steps)."""
        optimizer = self._optimizer()
        if self.enabled and optimizer is not None and not self._in_step:
            self._finish(optimizer)

    def host_buffer(self, param: torch.Tensor, key: Hashable) -> torch.Tensor | None:
        """The persistent host buffer of ``optimizer.state[param][key]``, if it has one."""
        slot = self._slots.get(param, {}).get(key)
        return None if slot is None else slot.host_local

    def remove(self) -> None:
        """Detach: states go back to the device and the optimizer's state is a plain mapping again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        optimizer = self._optimizer()
        if not self.enabled or optimizer is None:
            return
        if self._in_step:
            self._finish(optimizer)
        state = optimizer.state
        with torch.no_grad():
            for param, slots in self._slots.items():
                entry = dict.get(state, param)
                for key, slot in slots.items():
                    if entry is not None and entry.get(key) is slot.host_value:
                        entry[key] = slot.to_device(non_blocking=False)
        optimizer.state = defaultdict(dict, state)
        self._slots.clear()
        if getattr(optimizer, SWAPPER_ATTR, None) is self:
            delattr(optimizer, SWAPPER_ATTR)

    def touch(self, key: Hashable) -> None:
        """Called by the state map on every lookup: make the key's param group resident."""
        if not self._in_step:
            return
        group = self._group_of.get(key)
        if group is not None and group != self._active:
            self._activate(group)

    # ----- hooks ------------------------------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._in_step:  # the last step raised before its post-hook ran
            self._finish(optimizer)
        self._begin(optimizer)
        self._in_step = True
        if self._groups:
            self._prefetch(0)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._finish(optimizer)

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        # load_state_dict replaced optimizer.state with a plain mapping of device tensors.
        self._finish(optimizer)

    # ----- the swap -----------------------------------------------------------------------
    def _wrap_state(self, optimizer: torch.optim.Optimizer) -> None:
        # Again at every hook: load_state_dict (or the user) may have replaced the mapping.
        state = optimizer.state
        if not (isinstance(state, SwapStateMap) and state._swapper is self):
            optimizer.state = state = SwapStateMap.wrap(state, self)
        self._state = state

    def _begin(self, optimizer: torch.optim.Optimizer) -> None:
        self._wrap_state(optimizer)
        # Re-read every step: add_param_group and load_state_dict may change the groups.
        self._groups = [list(group["params"]) for group in optimizer.param_groups]
        self._group_of = {param: k for k, params in enumerate(self._groups) for param in params}
        self._streams.bind_compute()
        self._pending.clear()
        self._resident.clear()
        self._active = None

    def _finish(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy out every state still on the device (including ones the step created) and wait."""
        if not self._in_step:
            self._begin(optimizer)
        self._in_step = False
        self._pending.clear()  # prefetched but never used: nothing changed, drop the copies
        self._copy_out(range(len(self._groups)))
        self._active = None
        self._streams.synchronize()

    def _activate(self, group: int) -> None:
        self._active = group
        if group not in self._resident:
            self._prefetch(group)
            self._install(group)
        if group + 1 < len(self._groups):
            self._prefetch(group + 1)
        if self.early_copy_out:
            done = sorted(k for k in self._resident if k < group)
            if done:
                self._copy_out(done)

    def _state_entry(self, param: torch.Tensor) -> dict | None:
        return self._state.peek(param)

    def _prefetch(self, group: int) -> None:
        """Start copying the group's host states to the device; ``_install`` makes them visible."""
        if group in self._pending or group in self._resident:
            return
        copies = []
        with self._streams.copying(), torch.no_grad():
            for param in self._groups[group]:
                entry, slots = self._state_entry(param), self._slots.get(param)
                if not entry or not slots:
                    continue
                for key, slot in slots.items():
                    if entry.get(key) is slot.host_value:
                        copies.append((param, key, slot, slot.to_device(non_blocking=self._streams.active)))
        self._pending[group] = (self._streams.mark_copies() if copies else None, copies)

    def _install(self, group: int) -> None:
        event, copies = self._pending.pop(group)
        self._streams.compute_waits(event)
        moved = 0
        for param, key, slot, value in copies:
            entry = self._state_entry(param)
            if entry is None or entry.get(key) is not slot.host_value:
                continue  # replaced since the prefetch: the new value wins
            local = local_tensor(value, differentiable=False)
            self._streams.used_on_compute(local)
            entry[key] = value
            moved += local.numel() * local.element_size()
        self._resident.add(group)
        if moved:
            self.stats.swap_ins[group] += 1
            self.stats.bytes_in += moved

    def _is_device_state(self, param: torch.Tensor, key: Hashable, value: object) -> bool:
        slot = self._slots.get(param, {}).get(key)
        if slot is not None and value is slot.host_value:
            return False  # already out (on CPU the host buffer is also on the "device")
        return swappable(value, self.device_type)

    def _slot_for(self, param: torch.Tensor, key: Hashable, value: torch.Tensor) -> HostSlot:
        slots = self._slots.setdefault(param, {})
        slot = slots.get(key)
        if slot is None or not slot.fits(value):
            slot = slots[key] = HostSlot.for_value(value, self.device_type)
        return slot

    def _copy_out(self, groups: Iterable[int]) -> None:
        self._streams.copies_wait_for_compute()
        with self._streams.copying(), torch.no_grad():
            for group in groups:
                self._resident.discard(group)
                moved = 0
                for param in self._groups[group]:
                    entry = self._state_entry(param)
                    for key, value in list(entry.items()) if entry else ():
                        if not self._is_device_state(param, key, value):
                            continue
                        slot = self._slot_for(param, key, value)
                        local = local_tensor(value, differentiable=False)
                        slot.host_local.copy_(local, non_blocking=self._streams.active)
                        slot.remember(local)
                        self._streams.used_on_copies(local)
                        entry[key] = slot.host_value
                        moved += local.numel() * local.element_size()
                if moved:
                    self.stats.swap_outs[group] += 1
                    self.stats.bytes_out += moved


def swap_optimizer_states(optimizer: torch.optim.Optimizer, *, device_type: str | None = None,
                          force: bool = False) -> OptimizerStateSwapper:
    """Keep ``optimizer``'s states in (pinned) host memory between steps; returns its swapper.

    Works for any ``torch.optim`` optimizer, before or after its first step. On a
    device without streams (CPU) it is a logged no-op unless ``force=True``, which runs
    the real swap path with synchronous host copies. Calling it twice returns the
    same swapper.
    """
    existing = getattr(optimizer, SWAPPER_ATTR, None)
    if existing is not None:
        return existing
    swapper = OptimizerStateSwapper(optimizer, device_type=device_type or device_type_of(optimizer), force=force)
    swapper.offload()
    return swapper
