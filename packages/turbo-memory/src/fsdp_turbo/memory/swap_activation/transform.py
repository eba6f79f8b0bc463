"""The facade's ``swap_activation`` transform: an ``ActivationSwapper`` on the planned blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.device import has_streams
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_inspect import select_blocks
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.recompute.apply import is_recomputed
from fsdp_turbo.memory.swap_activation.swapper import ActivationSwapper

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

_log = get_logger(__name__)

SWAPPER_ATTR = "fsdp_turbo_activation_swapper"


@dataclass(frozen=True)
class SwapActivationPlan(FeaturePlan):
    blocks: tuple[str, ...]  # the blocks whose saved tensors move to the host
    recomputed: tuple[str, ...]  # planned blocks left out: recompute already frees their activations
    active: bool  # False: no streams on this device and no swap_activation_force, so a no-op
    force: bool

    def describe(self) -> tuple[PlanRow, ...]:
        rows = (PlanRow("swap_activation_plan", self.blocks),)
        return rows + ((PlanRow("swap_activation_plan (skipped: recomputed)", self.recomputed),)
                       if self.recomputed else ())

    def estimate(self, memory: MemoryModel) -> None:
        memory.swapped = self.active and bool(self.blocks)


def _recomputed_here_or_above(model: nn.Module, name: str, recomputed: set[str]) -> bool:
    # An enclosing checkpoint re-runs this block in backward; its hooks must see every tensor.
    parts = name.split(".") if name else []
    ancestors = [".".join(parts[:depth]) for depth in range(len(parts) + 1)]
    return any(a in recomputed or is_recomputed(model.get_submodule(a)) for a in ancestors)


class SwapActivationTransform(Transform):
    """Swap the saved activations of ``swap_activation_plan`` (default: the repeated blocks).

    Receives the recompute plan: blocks it checkpoints are skipped. Runs before
    ``fully_shard``, whose pre-forward all-gather runs first anyway (FSDP2 prepends it).
    """

    name = "swap_activation"
    stage = Stage.SWAP_ACTIVATION
    requires = ("recompute",)

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans) -> SwapActivationPlan:
        blocks = select_blocks(model, config.swap_activation_plan, field="swap_activation_plan")
        recompute = upstream["recompute"]
        checkpointed = set(recompute.blocks) if recompute is not None else set()
        recomputed = tuple(name for name in blocks if _recomputed_here_or_above(model, name, checkpointed))
        kept = tuple(name for name in blocks if name not in recomputed)
        active = has_streams(parallel_state.device_type) or config.swap_activation_force
        return SwapActivationPlan(kept, recomputed, active, config.swap_activation_force)

    def apply(self, model: nn.Module, plan: SwapActivationPlan, parallel_state: ParallelState) -> nn.Module:
        device_type = parallel_state.device_type
        if not plan.active:
            _log.info(f"swap_activation: no-op on {device_type!r}; set swap_activation_force=True to run it anyway")
            return model
        if plan.recomputed:
            _log.info(f"swap_activation: skipping {len(plan.recomputed)} recomputed block(s) {list(plan.recomputed)}; "
                      "recompute already frees their activations")
        if not plan.blocks:
            return model
        swapper = ActivationSwapper([model.get_submodule(name) for name in plan.blocks], device_type=device_type,
                                    force=plan.force).attach()
        setattr(model, SWAPPER_ATTR, swapper)
        _log.info(f"swap_activation: {len(plan.blocks)} block(s) on {device_type!r}, first {plan.blocks[0]!r}")
        return model
