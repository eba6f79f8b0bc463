"""The facade's ``swap_activation`` transform: an ``ActivationSwapper`` on the planned blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.device import has_streams
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.recompute.apply import hooks_own_saved_tensors, is_recomputed
from fsdp_turbo.memory.swap_activation.swapper import ActivationSwapper

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

_log = get_logger(__name__)

SWAPPER_ATTR = "fsdp_turbo_activation_swapper"


@dataclass(frozen=True)
class SwapActivationPlan(FeaturePlan):
    blocks: tuple[str, ...]  # the blocks whose saved tensors move to the host
    # Planned blocks left out: inside a recomputed block (its recompute re-runs them, hooks
    # and all), or under torch's composable checkpoint (its hooks own their tensors).
    skipped: tuple[tuple[str, str], ...]
    recomputed: tuple[str, ...]  # swapped blocks that are also recomputed: their checkpoint inputs move
    active: bool  # False: no streams on this device and no swap_force, so a no-op
    force: bool

    def describe(self) -> tuple[PlanRow, ...]:
        rows = [PlanRow("swap_activation_plan", self.blocks)]
        if self.recomputed:
            rows.append(PlanRow("swap_activation_plan (with recompute: the checkpoint inputs)", self.recomputed))
        by_reason: dict[str, list[str]] = {}
        for name, why in self.skipped:
            by_reason.setdefault(why, []).append(name)
        rows += [PlanRow(f"swap_activation_plan (skipped: {why})", tuple(names)) for why, names in by_reason.items()]
        return tuple(rows)

    def estimate(self, memory: MemoryModel) -> None:
        memory.swapped = self.active and bool(self.blocks)


def _why_skipped(model: nn.Module, name: str, recomputed: set[str]) -> str | None:
    parts = name.split(".") if name else []
    above = [".".join(parts[:depth]) for depth in range(len(parts))]
    if any(a in recomputed or is_recomputed(model.get_submodule(a)) for a in above):
        # The enclosing checkpoint re-runs this block, hooks and all, in backward.
        return "inside a recomputed block"
    if hooks_own_saved_tensors(model.get_submodule(name)):
        return "under torch's composable checkpoint"
    return None


class SwapActivationTransform(Transform):
    """Swap the saved activations of ``swap_activation_plan`` (default: the repeated blocks).

    Receives the recompute plan. A block that is also recomputed is swapped too: what its
    checkpoint keeps (the block's inputs) goes to the host and comes back for the
    recomputation, as Megatron's offloading does. Blocks inside a recomputed block are left
    out (the recompute re-runs them). Runs before
    ``fully_shard``, whose pre-forward all-gather runs first anyway (FSDP2 prepends it).
    """

    name = "swap_activation"
    stage = Stage.SWAP_ACTIVATION
    requires = ("recompute",)

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> SwapActivationPlan:
        blocks = facts.block_modules(model, config.swap_activation_plan, field="swap_activation_plan")
        recompute = upstream["recompute"]
        checkpointed = set(recompute.blocks) if recompute is not None else set()
        skipped = tuple((name, why) for name in blocks if (why := _why_skipped(model, name, checkpointed)))
        kept = tuple(name for name in blocks if name not in dict(skipped))
        stacked = tuple(name for name in kept if name in checkpointed or is_recomputed(model.get_submodule(name)))
        active = has_streams(parallel_state.device_type) or config.swap_force
        return SwapActivationPlan(kept, skipped, stacked, active, config.swap_force)

    def apply(self, model: nn.Module, plan: SwapActivationPlan, parallel_state: ParallelState) -> nn.Module:
        device_type = parallel_state.device_type
        if not plan.active:
            _log.warning(f"swap_activation skipped: {device_type!r} has no streams to overlap the copies with, "
                         "and its host is its device; set swap_force=True to run it anyway")
            return model
        if plan.skipped:
            _log.warning("swap_activation: skipping " + "; ".join(f"{name} ({why})" for name, why in plan.skipped))
        if not plan.blocks:
            return model
        swapper = ActivationSwapper([model.get_submodule(name) for name in plan.blocks], device_type=device_type,
                                    force=plan.force).attach()
        setattr(model, SWAPPER_ATTR, swapper)
        _log.info(f"swap_activation: {len(plan.blocks)} block(s) on {device_type!r}, first {plan.blocks[0]!r}")
        return model
