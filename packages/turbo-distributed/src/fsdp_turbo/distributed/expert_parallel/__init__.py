"""Expert parallel for MoE: experts split over EP ranks, tokens moved by all-to-all.

``apply_expert_parallel`` (or the ``expert_parallel`` transform) converts the expert
containers the plan picks; ``shard_experts`` puts expert FSDP on top. Dispatchers:
``eager``, ``fused`` and ``mc2``; all give the same numbers.
"""

from fsdp_turbo.distributed.expert_parallel.dispatchers import DISPATCHERS, ExpertGroup
from fsdp_turbo.distributed.expert_parallel.experts import ExpertAdapter, ExpertList, FusedExperts, expert_adapter
from fsdp_turbo.distributed.expert_parallel.module import ExpertParallel, is_expert_parallel, make_expert_parallel
from fsdp_turbo.distributed.expert_parallel.plan import EPPlan, resolve_ep_plan
from fsdp_turbo.distributed.expert_parallel.sharding import expert_fsdp_mesh, shard_experts
from fsdp_turbo.distributed.expert_parallel.transform import (
    ExpertParallelTransform,
    apply_ep_plan,
    apply_expert_parallel,
)

__all__ = [
    "DISPATCHERS",
    "EPPlan",
    "ExpertAdapter",
    "ExpertGroup",
    "ExpertList",
    "ExpertParallel",
    "ExpertParallelTransform",
    "FusedExperts",
    "apply_ep_plan",
    "apply_expert_parallel",
    "expert_adapter",
    "expert_fsdp_mesh",
    "is_expert_parallel",
    "make_expert_parallel",
    "resolve_ep_plan",
    "shard_experts",
]
