"""Ulysses context parallel: the sequence is split over CP ranks; attention all-to-alls
Q/K/V to head shards and back. No change to the model or the training loop."""

from fsdp_turbo.distributed.context_parallel.context import CPState
from fsdp_turbo.distributed.context_parallel.loss import sum_over_cp
from fsdp_turbo.distributed.context_parallel.plan import CPPlan, CPTarget, resolve_cp_target
from fsdp_turbo.distributed.context_parallel.transform import (
    ContextParallelTransform,
    apply_context_parallel,
    apply_cp_plan,
)

__all__ = ["CPPlan", "CPState", "CPTarget", "ContextParallelTransform", "apply_context_parallel", "apply_cp_plan",
           "resolve_cp_target", "sum_over_cp"]
