"""The facade's ``swap_optimizer`` transform.

The user builds the optimizer after ``FSDPTurbo`` returns, so the transform cannot
wrap it: it registers a global step pre-hook that, on the first step of any
optimizer owning one of the model's parameters, attaches an
:class:`OptimizerStateSwapper` to it. That first step's post-hook already swaps
the states it created out.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_turbo.core.device import has_streams
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.plugin import FeaturePlan, Plans, Stage, Transform
from fsdp_turbo.memory.swap_optimizer.swapper import SWAPPER_ATTR, OptimizerStateSwapper

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel
    from fsdp_turbo.core.model_facts import ModelFacts
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

_log = get_logger(__name__)

HANDLE_ATTR = "_fsdp_turbo_optimizer_swap_handle"


class ModelOptimizerSwap:
    """Attaches a swapper to each optimizer that steps a parameter of one model.

    Holds the model weakly; the global hook goes away with the model or with
    :meth:`remove`. Swappers already attached stay until their optimizer goes.
    """

    def __init__(self, model: nn.Module, *, device_type: str, force: bool) -> None:
        self.device_type = device_type
        self.force = force
        self.swappers: weakref.WeakSet[OptimizerStateSwapper] = weakref.WeakSet()
        self._model = weakref.ref(model)
        # Optimizer -> its group count when found not to own a model parameter;
        # add_param_group makes it look again.
        self._foreign: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._handle = register_optimizer_step_pre_hook(self._on_step)
        self._finalizer = weakref.finalize(model, self._handle.remove)

    def remove(self) -> None:
        self._finalizer()

    def _owns_model_parameter(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
        # Read lazily and by identity: FSDP replaces the parameters after FSDPTurbo returns.
        ids = {id(param) for param in model.parameters()}
        return any(id(param) in ids for group in optimizer.param_groups for param in group["params"])

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        model = self._model()
        if model is None or getattr(optimizer, SWAPPER_ATTR, None) is not None:
            return
        if self._foreign.get(optimizer) == len(optimizer.param_groups):
            return
        if not self._owns_model_parameter(optimizer, model):
            self._foreign[optimizer] = len(optimizer.param_groups)
            return
        self._foreign.pop(optimizer, None)
        # Its own pre-hook runs later in this same step; if a torch release stopped
        # doing that, the post-hook would still swap this step's states out.
        self.swappers.add(OptimizerStateSwapper(optimizer, device_type=self.device_type, force=self.force))
        _log.info(f"optimizer-state swap attached to {type(optimizer).__name__}")


@dataclass(frozen=True)
class SwapOptimizerPlan(FeaturePlan):
    active: bool  # False: no streams on this device and no swap_force, so a no-op
    force: bool

    def estimate(self, memory: MemoryModel) -> None:
        memory.optimizer_on_device = not self.active


class SwapOptimizerTransform(Transform):
    """``swap_optimizer=True``: optimizer states live in (pinned) host memory between steps."""

    name = "swap_optimizer"
    stage = Stage.OPTIMIZER_HOOKS

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> SwapOptimizerPlan:
        # Any optimizer and any model work: nothing to check.
        active = has_streams(parallel_state.device_type) or config.swap_force
        return SwapOptimizerPlan(active, config.swap_force)

    def apply(self, model: nn.Module, plan: SwapOptimizerPlan, parallel_state: ParallelState) -> nn.Module:
        device_type = parallel_state.device_type
        if not plan.active:
            _log.warning(f"swap_optimizer skipped: {device_type!r} has no streams to overlap the copies with, "
                         "and its host is its device; set swap_force=True to swap anyway")
            return model
        previous = getattr(model, HANDLE_ATTR, None)
        if previous is not None:
            previous.remove()
        setattr(model, HANDLE_ATTR, ModelOptimizerSwap(model, device_type=device_type, force=plan.force))
        return model
