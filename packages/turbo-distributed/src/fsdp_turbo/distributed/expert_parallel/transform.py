"""The expert-parallel transform: shard experts over EP and route tokens to them."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.distributed.expert_parallel.dispatchers import ExpertGroup
from fsdp_turbo.distributed.expert_parallel.module import make_expert_parallel
from fsdp_turbo.distributed.expert_parallel.plan import resolve_ep_plan
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPTurboConfig

_log = get_logger(__name__)


def apply_expert_parallel(model: nn.Module, plan: EPPlanConfig, ep_mesh) -> dict[str, nn.Module]:
    """Expert parallel without the facade: ``ep_mesh`` is a 1-D DeviceMesh over the EP group.
    Returns the converted containers; shard them with ``fully_shard`` (see ``sharding``)."""
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    adapters = resolve_ep_plan(model, plan, ep_size)
    group = ep_mesh.get_group()
    converted = {}
    for name, adapter in adapters.items():
        experts = ExpertGroup(adapter, adapter.num_experts, ep_size, group, plan.num_chunks)
        converted[name] = make_expert_parallel(model.get_submodule(name), experts, ep_rank, plan.dispatcher,
                                               ep_mesh)
    return converted


class ExpertParallelTransform(Transform):
    """Experts split over ``expert_parallel_size`` ranks; tokens travel by all-to-all."""

    name = "expert_parallel"
    stage = Stage.EXPERT_PARALLEL

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        return parallel_state.ep_size > 1

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        if parallel_state.tp_size > 1 and not config.tp_plan.sequence_parallel:
            # Without sequence parallel every TP rank holds the same tokens and would send
            # them all to the experts again (Megatron requires sequence parallel here too).
            raise ConfigError("tp_plan.sequence_parallel", list(config.tp_plan.sequence_parallel),
                              "enable sequence parallel (e.g. ['*layernorm', 'model.norm']) with expert "
                              "parallel and tensor parallel together",
                              reason="expert parallel with tensor parallel needs each TP rank to hold its "
                                     "own tokens")
        resolve_ep_plan(model, config.ep_plan, parallel_state.ep_size)

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        converted = apply_expert_parallel(model, config.ep_plan, parallel_state.mesh("ep"))
        _log.info(f"expert_parallel over {parallel_state.ep_size} ranks ({config.ep_plan.dispatcher}): "
                  f"{len(converted)} expert containers; {parallel_state.describe()}")
        return model
