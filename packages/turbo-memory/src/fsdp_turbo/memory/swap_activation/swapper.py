"""``ActivationSwapper``: offload the saved activations of chosen modules to the host.

Forward: module i's saved tensors go into a group; when module i+1 starts, group i
is copied out asynchronously (its device copies are dropped when module i+1 ends),
so the last module of a forward stays on device.
Backward: the first unpack of group i starts the copy-in of group i-1.

Why not torch's ``torch.autograd.graph.save_on_cpu``: it copies every saved tensor out
synchronously as it is saved (parameters and FSDP's all-gathered weights included) and
back only when backward reaches it, with no prefetch and no per-module choice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from fsdp_turbo.core.autograd_state import in_backward
from fsdp_turbo.core.device import detect_device_type, has_streams
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_inspect import is_dtensor, local_tensor
from fsdp_turbo.memory.recompute.apply import hooks_own_saved_tensors
from fsdp_turbo.memory.swap_activation.filters import (
    state_holders,
    state_storages,
)
from fsdp_turbo.memory.swap_activation.group import DTensorHandle, Handle, State, SwapGroup, unpack
from fsdp_turbo.memory.swap_activation.mover import Mover, SwapStats

_log = get_logger(__name__)


class _Sequence:
    """The modules of one forward pass, in the order they ran."""

    def __init__(self) -> None:
        self.ran: set[int] = set()
        self.last: SwapGroup | None = None
        self.offloading: SwapGroup | None = None

    def release_offloading(self) -> None:
        if self.offloading is not None:
            self.offloading.release()
            self.offloading = None

    def begin(self, group: SwapGroup) -> None:
        self.release_offloading()
        if self.last is not None:
            self.last.close(offload=True)
            self.offloading = self.last
        self.ran.add(group.index)
        self.last = group

    def end(self) -> None:
        self.release_offloading()
        if self.last is not None:
            # Backward starts with the last module, so it is never offloaded.
            self.last.close(offload=False)
            self.last = None


class ActivationSwapper:
    """Swap the autograd-saved tensors of ``modules`` to host memory and back.

    ``modules`` run in this order in forward (e.g. the decoder layers) and must not
    contain one another. On a device without streams (CPU) the swapper is a no-op
    unless ``force=True``, which runs the same pack/unpack path with synchronous
    CPU-to-CPU copies. Tensors under ``min_bytes`` stay where they are.

    Use ``attach()``/``detach()``, or ``with ActivationSwapper(...):``. Saved tensors
    packed while attached can still be unpacked after ``detach()``.
    """

    def __init__(self, modules: Sequence[nn.Module], *, device_type: str | None = None, force: bool = False,
                 min_bytes: int = 0) -> None:
        modules = list(modules)
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("ActivationSwapper: a module is listed twice")
        for outer in modules:
            for inner in modules:
                if inner is not outer and any(sub is inner for sub in outer.modules()):
                    raise ValueError(f"ActivationSwapper: {type(inner).__name__} is inside "
                                     f"{type(outer).__name__}; pass the outermost modules only")
        if min_bytes < 0:
            raise ValueError(f"ActivationSwapper: min_bytes={min_bytes} must be >= 0")
        self.device_type = detect_device_type(device_type)
        self.force = force
        self.min_bytes = min_bytes
        self.enabled = has_streams(self.device_type) or force
        self.stats = SwapStats()
        self.skipped: list[int] = []
        self._modules = modules
        self._holders = [state_holders(m) for m in modules]
        self._mover = Mover(self.device_type, self.stats)
        self._hooks: list[RemovableHandle] = []
        self._active: list[tuple[int, saved_tensors_hooks]] = []
        self._sequence: _Sequence | None = None

    # ----- attach / detach ---------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def attach(self) -> Self:
        """Register the module hooks (idempotent). A logged no-op on CPU without ``force``."""
        if self._hooks:
            return self
        if not self.enabled:
            _log.info(f"activation swap: no-op on {self.device_type!r} (no device memory to free); "
                      "use force=True to run the swap path anyway")
            return self
        # A block under our recompute swaps what the checkpoint keeps (its inputs); one under
        # torch's composable checkpoint keeps them behind that checkpoint's own hooks.
        self.skipped = [i for i, module in enumerate(self._modules) if hooks_own_saved_tensors(module)]
        if self.skipped:
            _log.warning(f"activation swap: skipping {len(self.skipped)} module(s) {self.skipped} under torch's "
                         "composable checkpoint, whose hooks own their saved tensors (use FSDPTurbo's recompute, "
                         "which stacks with the swap)")
        for index, module in enumerate(self._modules):
            if index in self.skipped:
                continue
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, index)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._post_forward, index),
                                                            always_call=True))
        return self

    def detach(self) -> None:
        """Remove the hooks; already-packed tensors keep working."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._exit_from(0)
        if self._sequence is not None:
            self._sequence.end()
            self._sequence = None

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.detach()

    # ----- module hooks -------------------------------------------------------------------
    def _pre_forward(self, index: int, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or in_backward() or torch.compiler.is_compiling():
            return
        sequence = self._sequence
        if sequence is None or index in sequence.ran:
            # A module that already ran means a new forward (gradient accumulation, next step).
            if sequence is not None:
                sequence.end()
            sequence = self._sequence = _Sequence()
        group = SwapGroup(index, sequence.last, self._mover)
        sequence.begin(group)
        hooks = saved_tensors_hooks(functools.partial(self._pack, group), unpack)
        hooks.__enter__()
        self._active.append((index, hooks))

    def _post_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        # always_call=True: runs even when the forward raised, so the hooks never leak.
        for position in range(len(self._active) - 1, -1, -1):
            if self._active[position][0] == index:
                self._exit_from(position)
                # The previous module's copy-out has overlapped this forward; drop its device
                # copies now, so only the last module's activations stay when forward ends.
                if self._sequence is not None:
                    self._sequence.release_offloading()
                return

    def _exit_from(self, position: int) -> None:
        # Innermost first: saved_tensors_hooks is a stack.
        while len(self._active) > position:
            _, hooks = self._active.pop()
            hooks.__exit__(None, None, None)

    # ----- pack ----------------------------------------------------------------------------
    def _pack(self, group: SwapGroup, tensor: torch.Tensor) -> Any:
        # Detach: holding the input itself would make a reference cycle through its grad_fn.
        if group.state is not State.OPEN:
            return tensor.detach()
        dtensor = is_dtensor(tensor) and not isinstance(tensor, nn.Parameter)
        local = local_tensor(tensor, differentiable=False) if dtensor else tensor
        if not self._swappable(group.index, local):
            return tensor.detach()
        entry = group.add(local)
        if dtensor:
            return DTensorHandle(entry, tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        return Handle(entry)

    def _swappable(self, index: int, tensor: torch.Tensor) -> bool:
        # Exact type: parameters and other tensor subclasses (quantized, fake) stay put.
        if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
            return False
        if tensor.device.type != self.device_type or tensor.numel() == 0:
            return False
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return False
        # By storage, not type: views of (all-gathered) parameters must not be swapped.
        return tensor.untyped_storage().data_ptr() not in state_storages(self._holders[index])


def swap_activations(modules: Sequence[nn.Module], *, device_type: str | None = None, force: bool = False,
                     min_bytes: int = 0) -> ActivationSwapper:
    """``with swap_activations(model.model.layers): loss = model(...); loss.backward()``."""
    return ActivationSwapper(modules, device_type=device_type, force=force, min_bytes=min_bytes)
