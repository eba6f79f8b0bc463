"""Expert FSDP: expert parameters shard over the ``(edp, efsdp)`` expert mesh, everything
else over the dense FSDP mesh. One implementation, :func:`fully_shard_experts`, serves the
facade (:func:`shard_experts`) and the module API (``expert_fully_shard_modules``).

Each EP rank's expert gradients already sum the contributions of every source rank's
tokens (the all-to-all's backward), so averaging them over the expert mesh alone would
over-count by ``ep``. Dense and expert parameters must both end as the mean over the
job's data shards, so the experts divide by the data-parallel size instead. Experts that
no FSDP reduces (the module API without ``expert_fully_shard_modules``, e.g. at efsdp = 1)
get the same division from a gradient hook (:func:`divide_expert_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_turbo.core.parallel_state import ParallelState, expert_shard_dim

_HOOKS = "ep_gradient_division"  # on an expert container: the handles of its division hooks


def expert_fsdp_mesh(state: ParallelState):
    """``efsdp``, with a leading ``edp`` (HSDP) dim when experts are also replicated."""
    return state.mesh("edp", "efsdp") if state.edp_size > 1 else state.mesh("efsdp")


def expert_placement(num_local_experts: int, efsdp: int) -> Callable[[nn.Parameter], Shard]:
    """Shard(0) (whole experts per rank) when there are enough local experts, else Shard(1)."""
    placement = Shard(expert_shard_dim(num_local_experts, efsdp))
    return lambda _param: placement


def expert_gradient_divide_factor(state: ParallelState) -> float:
    # The dense FSDP mesh spans dp_replicate x fsdp x cp: its mean is the job's mean.
    return float(state.sizes.dp_replicate_x_fsdp * state.sizes.cp)


def divide_expert_gradients(container: nn.Module, factor: float) -> None:
    """Divide each gradient reaching the container's parameters by ``factor``, for experts no
    FSDP reduces. A tensor hook, so it runs once per backward before accumulation (gradient
    accumulation stays a sum of means). Replaces earlier division hooks of the container."""
    stop_dividing_expert_gradients(container)
    handles = [param.register_hook(lambda grad: grad / factor) for param in container.parameters()
               if param.requires_grad]  # a LoRA model's frozen experts get no gradient
    object.__setattr__(container, _HOOKS, handles)


def stop_dividing_expert_gradients(container: nn.Module) -> None:
    for handle in getattr(container, _HOOKS, ()):
        handle.remove()
    object.__setattr__(container, _HOOKS, [])


def clear_of_strided_dims(placement: Callable[[nn.Parameter], Shard]) -> Callable[[nn.Parameter], Shard]:
    """``placement``, but never on a dim EP holds as ``_StridedShard`` (a LoRA ``lora_B``'s
    interleaved expert columns): FSDP would record the wrong layout there. Dim 0 instead."""
    def chosen(param: nn.Parameter) -> Shard:
        shard = placement(param)
        strided = {p.dim for p in getattr(param, "placements", ()) if isinstance(p, _StridedShard)}
        return Shard(0) if shard.dim in strided else shard
    return chosen


def fully_shard_experts(container: nn.Module, mesh, divide_factor: float,
                        placement: Callable[[nn.Parameter], Shard], **fully_shard_kwargs) -> nn.Module:
    """``fully_shard`` one expert-parallel container on ``mesh`` (1-D, or 2-D for HSDP), its
    gradients divided by ``divide_factor`` (FSDP's reduction replaces any division hook)."""
    stop_dividing_expert_gradients(container)
    fully_shard(container, mesh=mesh, shard_placement_fn=clear_of_strided_dims(placement), **fully_shard_kwargs)
    container.set_gradient_divide_factor(divide_factor)
    if mesh.device_type != "cuda" and mesh.shape[-1] > 1:  # the shard dim (HSDP: the last)
        # A custom divide factor becomes NCCL's PREMUL_SUM; other backends lack it, so
        # reduce with SUM and scale separately. Not with one shard rank: torch 2.13 then
        # divides in its copy and again afterwards (and needs no PREMUL_SUM anyway).
        container.set_force_sum_reduction_for_comms(True)
    return container


def shard_experts(experts: Mapping[str, nn.Module], state: ParallelState, divide_factor: float | None = None,
                  **fully_shard_kwargs) -> Mapping[str, nn.Module]:
    """``fully_shard`` expert-parallel containers (as ``apply_expert_parallel`` returns them)
    on the expert mesh; call before the dense units so they leave the expert parameters alone.
    ``divide_factor`` defaults to the dense data-parallel size."""
    if not experts:
        return experts
    mesh = expert_fsdp_mesh(state)
    factor = divide_factor if divide_factor is not None else expert_gradient_divide_factor(state)
    for module in experts.values():
        local = module.ep_experts.num_experts // module.ep_experts.ep_size
        fully_shard_experts(module, mesh, factor, expert_placement(local, state.efsdp_size), **fully_shard_kwargs)
    return experts


def upstream_placement(param: torch.Tensor) -> Shard:
    """The upstream's expert FSDP placement, which its clients' weight loaders assume (they
    slice dim 1 by the efsdp rank): Shard(1) for weights, Shard(0) for 1-D biases."""
    return Shard(1) if param.dim() > 1 else Shard(0)
