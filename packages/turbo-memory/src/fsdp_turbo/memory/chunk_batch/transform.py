"""The chunk_batch transform: the plan's modules (default: the repeated blocks) run in batch slices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.chunk_batch.apply import apply_chunk_batch

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

_log = get_logger(__name__)


@dataclass(frozen=True)
class ChunkBatchPlan(FeaturePlan):
    modules: tuple[str, ...]
    num_chunks: int
    recomputed: bool  # the chunked modules are the recomputed blocks: their re-run is sliced too

    def describe(self) -> tuple[PlanRow, ...]:
        return (PlanRow(f"chunk_batch_plan ({self.num_chunks} batch slices)", self.modules),)

    def estimate(self, memory: MemoryModel) -> None:
        # A recomputed block re-runs one slice at a time: its re-run peak is a slice's. The
        # forward's transient peak shrinks too, which this model (saved activations) does not hold.
        if self.recomputed:
            memory.rerun_slices = self.num_chunks


class ChunkBatchTransform(Transform):
    name = "chunk_batch"
    stage = Stage.CHUNK_BATCH  # after recompute: each slice is checkpointed on its own
    requires = ("recompute",)

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> ChunkBatchPlan:
        plan = config.chunk_batch_plan
        modules = facts.block_modules(model, plan.apply_modules, field="chunk_batch_plan.apply_modules")
        recompute = upstream["recompute"]
        recomputed = recompute is not None and set(modules) <= set(recompute.blocks)
        return ChunkBatchPlan(tuple(modules), plan.num_chunks, recomputed)

    def apply(self, model: nn.Module, plan: ChunkBatchPlan, parallel_state: ParallelState) -> nn.Module:
        apply_chunk_batch({name: model.get_submodule(name) for name in plan.modules}, plan.num_chunks)
        _log.info(f"chunk_batch: {len(plan.modules)} modules run in {plan.num_chunks} batch slices")
        return model
