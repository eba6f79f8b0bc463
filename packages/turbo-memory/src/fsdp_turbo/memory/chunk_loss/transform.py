"""The chunked-loss transform: HF causal LMs compute their labelled loss chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.core.stage_part import StageRole
from fsdp_turbo.fsdp_turbo_config import SPLIT_BACKWARD_SCHEDULES, FSDPTurboConfig
from fsdp_turbo.memory.chunk_loss.hf_head import ChunkedLossHandle, ChunkLossSettings, plan_chunked_loss

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

_log = get_logger(__name__)


@dataclass(frozen=True)
class ChunkLossPlan(FeaturePlan):
    head: str
    settings: ChunkLossSettings

    def describe(self) -> tuple[PlanRow, ...]:
        how = "" if self.settings.hf else " (the loop's lm_loss)"
        return (PlanRow("chunk_loss_plan.head_module", (self.head + how,)),)

    def estimate(self, memory: MemoryModel) -> None:
        memory.logit_chunk = self.settings.chunk_size


class ChunkLossTransform(Transform):
    # After tensor parallel (the head may be vocab-sharded), before FSDP (which wraps the head's class).
    name = "chunk_loss"
    stage = Stage.CHUNK_LOSS

    def on_stage(self, role: StageRole) -> bool:
        return role.last  # the pipeline stage holding the head

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> ChunkLossPlan:
        plan = config.chunk_loss_plan
        head, settings = plan_chunked_loss(model, facts, chunk_size=plan.chunk_size, z_loss_weight=plan.z_loss_weight,
                                           logit_softcap=plan.logit_softcap)
        split_backward = parallel_state.pp_size > 1 and config.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
        return ChunkLossPlan(head, replace(settings, backward_twice=split_backward))

    def apply(self, model: nn.Module, plan: ChunkLossPlan, parallel_state: ParallelState) -> nn.Module:
        handle = ChunkedLossHandle(model, model.get_submodule(plan.head), plan.settings)
        _log.info(f"chunk_loss: {type(handle.head).__name__} in chunks of {plan.settings.chunk_size} tokens")
        return model
