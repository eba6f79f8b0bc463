"""The pipeline transform: it splits the model into this rank's stages; the facade then
applies every other feature to each stage and hands the stages back to be joined."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Plans, Stage, Transform
from fsdp_turbo.distributed.pipeline_parallel.plan import PipelinePlan, plan_pipeline
from fsdp_turbo.distributed.pipeline_parallel.runner import PipelineRunner
from fsdp_turbo.distributed.pipeline_parallel.split import stage_module
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

_log = get_logger(__name__)


class PipelineParallelTransform(Transform):
    name = "pipeline_parallel"
    stage = Stage.PIPELINE
    splits_model = True

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> PipelinePlan:
        return plan_pipeline(config, model, parallel_state.pp_size, facts)

    def split(self, model: nn.Module, plan: PipelinePlan, state: ParallelState) -> list[tuple[object, nn.Module]]:
        local = plan.local_stages(state.pp_rank)
        # copies first, while the model is whole; this rank's first stage is the model itself
        parts = [(stage, stage_module(model, plan, stage, reuse=False)) for stage in local[1:]]
        parts.insert(0, (local[0], stage_module(model, plan, local[0], reuse=True)))
        _log.info(f"pipeline: stages {[stage.index for stage in local]} of {len(plan.stages)} "
                  f"({plan.schedule}, {plan.microbatches} micro-batches)")
        return parts

    def join(self, parts: list[tuple[object, nn.Module]], plan: PipelinePlan, state: ParallelState) -> PipelineRunner:
        return PipelineRunner(parts, plan, state)

    def apply(self, model: nn.Module, plan: PipelinePlan, state: ParallelState) -> nn.Module:
        raise RuntimeError("the facade splits the model through split() and join()")
