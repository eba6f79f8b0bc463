"""Expert FSDP: expert parameters shard over the ``(edp, efsdp)`` expert mesh, everything
else over the dense FSDP mesh.

Each EP rank's expert gradients already sum the contributions of every source rank's
tokens (the all-to-all's backward), so averaging them over the expert mesh alone would
over-count by ``ep``. Dense and expert parameters must both end as the mean over the
job's data shards, so the experts divide by the dense data-parallel size instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from fsdp_turbo.core.parallel_state import ParallelState


def expert_fsdp_mesh(state: ParallelState):
    """``efsdp``, with a leading ``edp`` (HSDP) dim when experts are also replicated."""
    return state.mesh("edp", "efsdp") if state.edp_size > 1 else state.mesh("efsdp")


def expert_placement(num_local_experts: int, efsdp: int) -> Callable[[nn.Parameter], Shard]:
    """Shard(0) (whole experts per rank) when there are enough local experts, else Shard(1)."""
    placement = Shard(0) if num_local_experts >= efsdp else Shard(1)
    return lambda _param: placement


def expert_gradient_divide_factor(state: ParallelState) -> float:
    # The dense FSDP mesh spans dp_replicate x fsdp x cp: its mean is the job's mean.
    return float(state.sizes.dp_replicate_x_fsdp * state.sizes.cp)


def shard_experts(experts: Mapping[str, nn.Module], state: ParallelState, **fully_shard_kwargs
                  ) -> Mapping[str, nn.Module]:
    """``fully_shard`` expert-parallel containers (as ``apply_expert_parallel`` returns them)
    on the expert mesh; call before the dense units so they leave the expert parameters alone."""
    if not experts:
        return experts
    mesh = expert_fsdp_mesh(state)
    for module in experts.values():
        local = module.ep_experts.num_experts // module.ep_experts.ep_size
        fully_shard(module, mesh=mesh, shard_placement_fn=expert_placement(local, state.efsdp_size),
                    **fully_shard_kwargs)
        module.set_gradient_divide_factor(expert_gradient_divide_factor(state))
        if state.device_type != "cuda" and state.efsdp_size > 1:
            # A custom divide factor becomes NCCL's PREMUL_SUM; other backends lack it, so
            # reduce with SUM and scale separately. Not with one shard rank: torch 2.13 then
            # divides in its copy and again afterwards (and needs no PREMUL_SUM anyway).
            module.set_force_sum_reduction_for_comms(True)
    return experts

