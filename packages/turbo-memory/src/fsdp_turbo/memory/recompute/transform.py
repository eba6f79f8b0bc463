"""The recompute transform: checkpoint the plan's outermost modules (default: the repeated blocks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.recompute.apply import check_not_recomputed, checkpoint_modules
from fsdp_turbo.memory.recompute.policy import context_fn_saving, save_ops_for

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

_log = get_logger(__name__)


@dataclass(frozen=True)
class RecomputePlan(FeaturePlan):
    blocks: tuple[str, ...]
    policy: str | tuple[str, ...]
    save_ops: frozenset[str] | None  # what a selective policy keeps; None: full recompute

    def describe(self) -> tuple[PlanRow, ...]:
        return (PlanRow("recompute_plan", self.blocks),)

    def estimate(self, memory: MemoryModel) -> None:
        # A checkpointed layer keeps its input (selective: and what the save ops return), and
        # one layer's full activations live while it re-runs.
        memory.recompute = "full" if self.save_ops is None else "selective"


class RecomputeTransform(Transform):
    name = "recompute"
    stage = Stage.RECOMPUTE

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> RecomputePlan:
        blocks = facts.block_modules(model, config.recompute_plan, field="recompute_plan")
        for name, block in blocks.items():
            check_not_recomputed(name, block)
        return RecomputePlan(tuple(blocks), config.recompute_policy, save_ops_for(config.recompute_policy))

    def apply(self, model: nn.Module, plan: RecomputePlan, parallel_state: ParallelState) -> nn.Module:
        context_fn = None if plan.save_ops is None else context_fn_saving(plan.save_ops)
        checkpoint_modules([model.get_submodule(name) for name in plan.blocks], context_fn)
        policy = plan.policy if isinstance(plan.policy, str) else "selective (custom ops)"
        _log.info(f"recompute ({policy}) on {len(plan.blocks)} modules")
        return model
