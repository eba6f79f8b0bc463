"""``expert_fully_shard_modules``: the upstream module-level entry point of expert FSDP, with
the signature its clients call (LLaMA-Factory's ``fsdpturbo`` backend, at efsdp > 1)::

    model = expert_fully_shard_modules(model, efsdp_mesh, ep_plan, fsdp_plan)

The facade's expert FSDP (``sharding.fully_shard_experts``) on the caller's mesh. What it
shards is exactly the expert-parallel containers inside the modules
``ep_plan.apply_efsdp_modules`` picks. A picked module may hold more (a ``mlp`` holds its
router and shared experts too): that stays with the caller's FSDP and is reduced over the
whole data-parallel group. Sharding it on the expert-FSDP mesh would reduce the router's
gradient over the efsdp ranks alone (the upstream does; the router then drifts).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.distributed.expert_parallel.expert_parallel import check_one_dim
from fsdp_turbo.distributed.expert_parallel.module import is_expert_parallel
from fsdp_turbo.distributed.expert_parallel.plan import containers_to_shard
from fsdp_turbo.distributed.expert_parallel.sharding import fully_shard_experts, upstream_placement
from fsdp_turbo.distributed.fully_shard_parallel.hook_modules import gather_at_hook_modules
from fsdp_turbo.distributed.fully_shard_parallel.policies import (
    mixed_precision_policy,
    offload_policy,
    reshard_after_forward,
)
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPPlanConfig

__all__ = ["expert_fully_shard_modules"]


def _expert_parallel_containers(model: nn.Module) -> dict[str, nn.Module]:
    found = {name: module for name, module in model.named_modules() if is_expert_parallel(module)}
    if not found:
        raise ConfigError("model", type(model).__name__, "call expert_parallelize_modules(model, ep_mesh, ep_plan) "
                          "first", reason="the model has no expert-parallel container")
    return found


def expert_fully_shard_modules(model: nn.Module, efsdp_mesh: DeviceMesh, ep_plan: EPPlanConfig,
                               fsdp_plan: FSDPPlanConfig | None = None) -> nn.Module:
    """``fully_shard`` the expert-parallel containers inside ``ep_plan.apply_efsdp_modules``
    (unset: all) on ``efsdp_mesh`` (1-D; 2-D ``(edp, efsdp)`` for HSDP); returns ``model``.

    Gradients are divided by ``ep_plan.gradient_divide_factor`` (unset: the EP size times
    the efsdp mesh size, the job's data-parallel ranks when they are all expert ranks); on
    backends without PREMUL_SUM (gloo) as a SUM followed by the division. ``fsdp_plan`` gives
    mixed precision, CPU offload and ``hook_modules`` (each hook module's forward start
    all-gathers the expert units inside it); its unit choices are the caller's FSDP's.
    Weights shard on dim 1 (biases dim 0), the placement the upstream's clients' loaders assume."""
    if efsdp_mesh.ndim == 1:
        check_one_dim(efsdp_mesh, "efsdp_mesh")
    elif efsdp_mesh.ndim != 2:
        raise ConfigError("efsdp_mesh", tuple(efsdp_mesh.shape), "pass a 1-D efsdp mesh, or 2-D (edp, efsdp)")
    fsdp_plan = fsdp_plan or FSDPPlanConfig()
    containers = _expert_parallel_containers(model)
    chosen = containers_to_shard(model, ep_plan.apply_efsdp_modules, tuple(containers),
                                 require_all=efsdp_mesh.size() > 1)
    ep_size = containers[chosen[0]].ep_experts.ep_size
    factor = ep_plan.gradient_divide_factor or float(ep_size * efsdp_mesh.size())
    kwargs = {"mp_policy": mixed_precision_policy(fsdp_plan, root=False),
              "reshard_after_forward": reshard_after_forward(fsdp_plan, root=False),
              "offload_policy": offload_policy(fsdp_plan, efsdp_mesh.device_type)}
    for name in chosen:
        fully_shard_experts(containers[name], efsdp_mesh, factor, upstream_placement, **kwargs)
    gather_at_hook_modules(model, fsdp_plan.hook_modules, [containers[name] for name in chosen])
    return model
