"""The expert-parallel experts: the user's expert module, with its forward replaced by a
dispatcher and only its EP rank's experts kept."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.distributed.expert_parallel.dispatchers import DISPATCHERS, Dispatcher, ExpertGroup
from fsdp_turbo.distributed.expert_parallel.routing import fixed_routing


class ExpertParallel(nn.Module):
    """Mixed into the experts' own class by :func:`make_expert_parallel`."""

    ep_experts: ExpertGroup
    ep_dispatcher: Dispatcher
    ep_fixed_router: bool = False  # ep_plan.fixed_router: route by position (benchmarks)

    # Eager under torch.compile (one graph break per MoE layer): the all-to-all splits are
    # host integers read from the routing, and the expert weights are DTensors on the EP mesh.
    @torch.compiler.disable
    def forward(self, *args, **kwargs) -> torch.Tensor:
        # The form turns the container's own call into the dispatchers' one.
        return self.ep_experts.adapter.run_forward(self.ep_dispatch, *args, **kwargs)

    def ep_dispatch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.ep_fixed_router:
            top_k_index, top_k_weights = fixed_routing(top_k_index, top_k_weights, self.ep_experts.num_experts)
        return self.ep_dispatcher(self, self.ep_experts, hidden_states, top_k_index, top_k_weights)


def is_expert_parallel(module: nn.Module) -> bool:
    return isinstance(module, ExpertParallel)


def make_expert_parallel(module: nn.Module, experts: ExpertGroup, ep_rank: int, dispatcher: str,
                         ep_mesh=None, *, fixed_router: bool = False) -> nn.Module:
    """Keep EP rank ``ep_rank``'s experts of ``module`` and route its forward through
    ``dispatcher``. ``ep_mesh`` (1-D, the EP group) makes fused weights DTensors.
    ``fixed_router``: route by position instead of by the router (``routing.fixed_routing``)."""
    local = experts.num_experts // experts.ep_size
    experts.adapter.keep_local_experts(module, ep_rank * local, local, ep_mesh)
    return mix_in(module, ExpertParallel, "EP", ep_experts=experts, ep_dispatcher=DISPATCHERS[dispatcher],
                  ep_fixed_router=fixed_router)
