"""Pipeline parallel: decoder layers split into stages over the ``pp`` mesh dim, run by
``torch.distributed.pipelining``'s schedules (GPipe, 1F1B, interleaved 1F1B, ZBV, DualPipeV)."""

from fsdp_turbo.distributed.pipeline_parallel.plan import PipelinePlan, plan_pipeline
from fsdp_turbo.distributed.pipeline_parallel.runner import PipelineRunner
from fsdp_turbo.distributed.pipeline_parallel.schedules import SCHEDULES
from fsdp_turbo.distributed.pipeline_parallel.transform import PipelineParallelTransform

__all__ = ["SCHEDULES", "PipelineParallelTransform", "PipelinePlan", "PipelineRunner", "plan_pipeline"]
