"""Expert parallel for MoE: experts split over EP ranks, tokens moved by all-to-all.

``apply_expert_parallel`` (or the ``expert_parallel`` transform) converts the expert
containers the plan picks; ``shard_experts`` puts expert FSDP on top. Dispatchers:
``eager``, ``fused``, ``mc2`` (token chunks, all-to-all overlapped with the previous chunk's
compute in the forward) and ``domino`` (independent token slices, each slice's all-to-alls
overlapped with the other slices' expert GEMMs in the forward and in the backward; see
``domino``); all give the same numbers. Expert containers are
recognised by the registered expert forms (``register_expert_form``); the built-in ones
are HF's fused experts, a ModuleList of experts, torchtitan's ``GroupedExperts`` and fused
experts inside PEFT's LoRA wrappers (``LoraConfig.target_parameters``; see ``lora_experts``).
"""

from fsdp_turbo.distributed.expert_parallel.counted_experts import CountedExperts
from fsdp_turbo.distributed.expert_parallel.dispatchers import DISPATCHERS, DominoDispatcher, ExpertGroup
from fsdp_turbo.distributed.expert_parallel.experts import ExpertList, FusedExperts
from fsdp_turbo.distributed.expert_parallel.forms import (
    ExpertAdapter,
    expert_adapter,
    expert_forms,
    keep_expert_rows,
    loop_over_experts,
    register_expert_form,
    unregister_expert_form,
)
from fsdp_turbo.distributed.expert_parallel.lora_experts import LoraExperts
from fsdp_turbo.distributed.expert_parallel.module import ExpertParallel, is_expert_parallel, make_expert_parallel
from fsdp_turbo.distributed.expert_parallel.plan import EPPlan, resolve_ep_plan
from fsdp_turbo.distributed.expert_parallel.sharding import expert_fsdp_mesh, shard_experts
from fsdp_turbo.distributed.expert_parallel.transform import (
    ExpertParallelTransform,
    apply_ep_plan,
    apply_expert_parallel,
)

__all__ = [
    "CountedExperts",
    "DISPATCHERS",
    "DominoDispatcher",
    "EPPlan",
    "ExpertAdapter",
    "ExpertGroup",
    "ExpertList",
    "ExpertParallel",
    "ExpertParallelTransform",
    "FusedExperts",
    "LoraExperts",
    "apply_ep_plan",
    "apply_expert_parallel",
    "expert_adapter",
    "expert_forms",
    "expert_fsdp_mesh",
    "is_expert_parallel",
    "keep_expert_rows",
    "loop_over_experts",
    "make_expert_parallel",
    "register_expert_form",
    "resolve_ep_plan",
    "shard_experts",
    "unregister_expert_form",
]
