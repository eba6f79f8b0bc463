"""The expert-parallel transform: shard experts over EP and route tokens to them."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts, plain_api_facts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Plans, Stage, Transform
from fsdp_turbo.distributed.expert_parallel.dispatchers import ExpertGroup
from fsdp_turbo.distributed.expert_parallel.lora_experts import LoraExperts
from fsdp_turbo.distributed.expert_parallel.module import make_expert_parallel
from fsdp_turbo.distributed.expert_parallel.plan import (
    EPPlan,
    check_replica_weights,
    containers_to_shard,
    resolve_ep_plan,
)
from fsdp_turbo.distributed.expert_parallel.replicas import ExpertReplicas
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPTurboConfig

_log = get_logger(__name__)


def apply_ep_plan(model: nn.Module, plan: EPPlan, ep_mesh) -> dict[str, nn.Module]:
    """Convert the plan's containers; ``ep_mesh`` is a 1-D DeviceMesh over the EP group.
    Returns the converted containers; shard them with ``fully_shard`` (see ``sharding``)."""
    ep_rank, group = ep_mesh.get_local_rank(), ep_mesh.get_group()
    for name, adapter in plan.containers:
        check_replica_weights(name, adapter, model.get_submodule(name), plan.redundant_experts)
    converted = {}
    for name, adapter in plan.containers:
        experts = ExpertGroup(adapter, adapter.num_experts, plan.ep, group, plan.num_chunks)
        replicas = (ExpertReplicas(adapter.num_experts, plan.ep, plan.redundant_experts, plan.rebalance_every,
                                   group, ep_rank) if plan.redundant_experts else None)
        converted[name] = make_expert_parallel(model.get_submodule(name), experts, ep_rank, plan.dispatcher,
                                               ep_mesh, fixed_router=plan.fixed_router, replicas=replicas)
    return converted


def apply_expert_parallel(model: nn.Module, plan: EPPlanConfig, ep_mesh,
                          facts: ModelFacts | None = None) -> dict[str, nn.Module]:
    """Expert parallel without the facade: resolve ``plan`` on ``model``, then convert.
    ``facts`` default to what the model says of itself."""
    facts = facts if facts is not None else plain_api_facts(model)
    return apply_ep_plan(model, resolve_ep_plan(model, plan, ep_mesh.size(), facts), ep_mesh)


def check_lora_expert_fsdp(plan: EPPlan, efsdp: int) -> None:
    """LoRA experts need whole experts per expert-FSDP rank. With fewer local experts than
    efsdp ranks, expert FSDP shards dim 1 (``expert_placement``), which for ``lora_B`` is the
    dim whose expert columns EP already holds strided (``_StridedShard``): FSDP2 then computes
    right but describes the shards wrongly, so ``full_tensor()``, ``state_dict`` and checkpoints
    of ``lora_B`` would come out permuted."""
    for name, adapter in plan.containers:
        local = adapter.num_experts // plan.ep
        if isinstance(adapter, LoraExperts) and local < efsdp:
            raise ConfigError("expert_fully_shard_parallel_size", efsdp,
                              f"keep at least one whole expert per expert-FSDP rank: an expert-FSDP size of at "
                              f"most {local}, or a smaller expert_parallel_size",
                              reason=f"{name} has LoRA on its experts and {local} experts per EP rank")


class ExpertParallelTransform(Transform):
    """Experts split over ``expert_parallel_size`` ranks; tokens travel by all-to-all."""

    name = "expert_parallel"
    stage = Stage.EXPERT_PARALLEL

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> EPPlan:
        plan = resolve_ep_plan(model, config.ep_plan, parallel_state.ep_size, facts)
        containers_to_shard(model, config.ep_plan.apply_efsdp_modules, plan.container_names, require_all=True)
        check_lora_expert_fsdp(plan, parallel_state.efsdp_size)
        return plan

    def apply(self, model: nn.Module, plan: EPPlan, parallel_state: ParallelState) -> nn.Module:
        converted = apply_ep_plan(model, plan, parallel_state.mesh("ep"))
        _log.info(f"expert_parallel over {plan.ep} ranks ({plan.dispatcher}): "
                  f"{len(converted)} expert containers; {parallel_state.describe()}")
        return model
