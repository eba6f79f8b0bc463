"""``expert_parallelize_modules``: the upstream module-level entry point of expert parallel,
with the signature its clients call (LLaMA-Factory's ``fsdpturbo`` backend)::

    model = expert_parallelize_modules(model, ep_mesh, ep_plan)

A layer over the facade's own implementation (``apply_expert_parallel``), not a second one.
The caller owns the process groups and the meshes; ``ep_mesh`` is any 1-D mesh (a slice of
the caller's own mesh, any dim name).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.distributed.expert_parallel.sharding import divide_expert_gradients
from fsdp_turbo.distributed.expert_parallel.transform import apply_expert_parallel
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

__all__ = ["expert_parallelize_modules"]


def check_one_dim(mesh: DeviceMesh, argument: str) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ConfigError(argument, shape, f"pass a 1-D DeviceMesh, e.g. expert_mesh['{argument.split('_')[0]}']")


def expert_parallelize_modules(model: nn.Module, ep_mesh: DeviceMesh, ep_plan: EPPlanConfig) -> nn.Module:
    """Split the expert containers ``ep_plan.apply_modules`` picks (unset: the model facts')
    over ``ep_mesh`` and route tokens to them with ``ep_plan.dispatcher``; returns ``model``.

    Gradients: each kept expert's gradient sums every EP rank's tokens. Until
    ``expert_fully_shard_modules`` takes them over, a gradient hook divides them by
    ``ep_plan.gradient_divide_factor`` (read now; unset: the EP size, right when the EP
    ranks are the job's data-parallel ranks). Nothing else reduces them: the caller's own
    FSDP must leave them out (its ``ignored_params``), as the upstream's clients do."""
    check_one_dim(ep_mesh, "ep_mesh")
    converted = apply_expert_parallel(model, ep_plan, ep_mesh)
    factor = ep_plan.gradient_divide_factor or float(ep_mesh.size())
    for container in converted.values():
        divide_expert_gradients(container, factor)
    return model
