"""The expert-parallel experts: the user's expert module, with its forward replaced by a
dispatcher and only its EP rank's experts kept."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.distributed.expert_parallel.dispatchers import DISPATCHERS, Dispatcher, ExpertGroup
from fsdp_turbo.distributed.expert_parallel.forms import replica_weights
from fsdp_turbo.distributed.expert_parallel.replicas import ExpertReplicas, fetch_replicas
from fsdp_turbo.distributed.expert_parallel.routing import fixed_routing


class ExpertParallel(nn.Module):
    """Mixed into the experts' own class by :func:`make_expert_parallel`."""

    ep_experts: ExpertGroup
    ep_dispatcher: Dispatcher
    ep_fixed_router: bool = False  # ep_plan.fixed_router: route by position (benchmarks)
    ep_replicas: ExpertReplicas | None = None  # ep_plan.redundant_experts > 0: replicas of hot experts

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
        if self.ep_replicas is None:
            return self.ep_dispatcher(self, self.ep_experts, hidden_states, top_k_index, top_k_weights)
        return self._dispatch_with_replicas(hidden_states, top_k_index, top_k_weights)

    def moe_rank_rows(self) -> list[int] | None:
        """Rows each EP rank computed in the last forward, when replicas move rows off their
        experts' ranks (read by ``core.moe_telemetry``); else ``None``."""
        return None if self.ep_replicas is None else self.ep_replicas.rank_rows

    def _dispatch_with_replicas(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Route over home and replica slots (``replicas``): the dispatchers see ``ep * width``
        experts, the replicas' weights fetched from their home ranks for this forward."""
        replicas = self.ep_replicas
        placement, slots = replicas.route(top_k_index, self.training and torch.is_grad_enabled())
        home = self.ep_experts.adapter.home_weights(self)
        fetched = fetch_replicas(home, placement, replicas.rank, replicas.group)
        experts = dataclasses.replace(self.ep_experts, num_experts=replicas.slots)
        with replica_weights(self, fetched):
            return self.ep_dispatcher(self, experts, hidden_states, slots, top_k_weights)


def is_expert_parallel(module: nn.Module) -> bool:
    return isinstance(module, ExpertParallel)


def make_expert_parallel(module: nn.Module, experts: ExpertGroup, ep_rank: int, dispatcher: str,
                         ep_mesh=None, *, fixed_router: bool = False,
                         replicas: ExpertReplicas | None = None) -> nn.Module:
    """Keep EP rank ``ep_rank``'s experts of ``module`` and route its forward through
    ``dispatcher``. ``ep_mesh`` (1-D, the EP group) makes fused weights DTensors.
    ``fixed_router``: route by position instead of by the router (``routing.fixed_routing``).
    ``replicas``: spread hot experts' tokens over replica slots (``replicas``)."""
    local = experts.num_experts // experts.ep_size
    experts.adapter.keep_local_experts(module, ep_rank * local, local, ep_mesh)
    return mix_in(module, ExpertParallel, "EP", ep_experts=experts, ep_dispatcher=DISPATCHERS[dispatcher],
                  ep_fixed_router=fixed_router, ep_replicas=replicas)
