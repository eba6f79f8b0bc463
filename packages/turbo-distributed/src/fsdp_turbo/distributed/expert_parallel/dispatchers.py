"""The four dispatchers. Each takes the experts' ``(hidden_states, top_k_index,
top_k_weights)`` and returns what the unsharded experts would, for the local tokens:

1. exchange per-expert token counts;
2. all-to-all the routed rows to their experts' ranks (uneven splits);
3. permute into expert-major order;
4. compute the local experts;
5. un-permute, all-to-all back, and apply the routing weights.

``eager`` runs the local experts one by one, each gathering its rows by mask; ``fused``
permutes once (a sort) and runs all local experts as grouped GEMMs; ``mc2`` is ``fused``
over token chunks, with chunk ``i + 1``'s all-to-all in flight while chunk ``i`` computes
(on NPU the op ``ep.mc2`` can be a fused dispatch-GEMM-combine kernel); ``domino`` is
``fused`` over independent token slices whose all-to-alls overlap the other slices' expert
GEMMs in the forward and in the backward too (``domino``'s docstring says how). All four
give the same numbers (up to float32 rounding where the chunks sum in another order).
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.distributed.expert_parallel.collectives import all_to_all, wait
from fsdp_turbo.distributed.expert_parallel.domino import InFlight, overlap_slices
from fsdp_turbo.distributed.expert_parallel.forms import ExpertAdapter
from fsdp_turbo.distributed.expert_parallel.ops import register_backends
from fsdp_turbo.distributed.expert_parallel.routing import (
    TokenRoute,
    build_route,
    count_tokens,
    exchange_counts,
    inverse_permutation,
    route_tokens,
)


@dataclass(frozen=True)
class ExpertGroup:
    """What a dispatcher needs to know about one EP-sharded expert container."""

    adapter: ExpertAdapter
    num_experts: int
    ep_size: int
    group: dist.ProcessGroup | None  # None: a single EP rank (no communication)
    num_chunks: int = 2  # token chunks of mc2 and slices of domino (ep_plan.num_chunks)


def send_rows(hidden: torch.Tensor, route: TokenRoute) -> torch.Tensor:
    return hidden[route.order // route.top_k]


def combine(back: torch.Tensor, route: TokenRoute, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Scatter returned rows to their (token, k) slots and sum them with the routing weights."""
    top_k, hidden = route.top_k, back.shape[-1]
    slots = back.new_zeros(num_tokens * top_k, hidden).index_copy(0, route.order, back)
    return (slots.view(num_tokens, top_k, hidden) * weights.unsqueeze(-1).to(back.dtype)).sum(1)


def _grouped_compute(module: nn.Module, experts: ExpertGroup, recv: torch.Tensor, route: TokenRoute) -> torch.Tensor:
    x = recv[route.expert_major]
    y = experts.adapter.grouped(module, x, route.group_sizes)
    return y[inverse_permutation(route.expert_major)]


class Dispatcher(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def __call__(self, module: nn.Module, experts: ExpertGroup, hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor: ...


class _SingleRouteDispatcher(Dispatcher):
    def compute(self, module: nn.Module, experts: ExpertGroup, recv: torch.Tensor,
                route: TokenRoute) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, module, experts, hidden_states, top_k_index, top_k_weights):
        route = route_tokens(top_k_index, experts.num_experts, experts.ep_size, experts.group)
        recv = all_to_all(send_rows(hidden_states, route), route.recv_splits, route.send_splits, experts.group)
        out = self.compute(module, experts, recv, route)
        back = all_to_all(out, route.send_splits, route.recv_splits, experts.group)
        return combine(back, route, top_k_weights, hidden_states.shape[0]).to(hidden_states.dtype)


class EagerDispatcher(_SingleRouteDispatcher):
    """A loop over local experts: the simple, obviously-correct baseline."""

    name = "eager"

    def compute(self, module, experts, recv, route):
        return experts.adapter.eager(module, recv, route.recv_expert)


class FusedDispatcher(_SingleRouteDispatcher):
    """One sort-based permute and grouped GEMMs over all local experts."""

    name = "fused"

    def compute(self, module, experts, recv, route):
        return _grouped_compute(module, experts, recv, route)


def chunk_routes(experts: ExpertGroup, top_k_index: torch.Tensor) -> tuple[list[tuple[int, int]], list[TokenRoute]]:
    """``experts.num_chunks`` contiguous token spans and each span's route; every span's counts
    travel in one collective."""
    # Every rank runs the same number of chunks (some may be empty), so collectives pair up.
    bounds = torch.linspace(0, top_k_index.shape[0], experts.num_chunks + 1).round().long().tolist()
    spans = list(itertools.pairwise(bounds))
    sorted_counts = [count_tokens(top_k_index[a:b], experts.num_experts) for a, b in spans]
    received = exchange_counts(torch.stack([c for _, c in sorted_counts]), experts.ep_size, experts.group)
    top_k = top_k_index.shape[-1]
    return spans, [build_route(order, counts, received[:, i], top_k) for i, (order, counts) in enumerate(sorted_counts)]


@register_op("ep.mc2")
def mc2_portable(module: nn.Module, experts: ExpertGroup, hidden_states: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Chunked fused dispatch: every chunk's counts travel in one collective, then chunk
    ``i + 1``'s rows are sent before chunk ``i`` is computed, and chunk ``i``'s results are
    sent back before chunk ``i + 1`` is computed."""
    spans, routes = chunk_routes(experts, top_k_index)

    def send(i: int) -> torch.Tensor:
        a, b = spans[i]
        return all_to_all(send_rows(hidden_states[a:b], routes[i]), routes[i].recv_splits,
                          routes[i].send_splits, experts.group)

    in_flight, returning = send(0), []
    for i, route in enumerate(routes):
        following = send(i + 1) if i + 1 < len(routes) else None
        out = _grouped_compute(module, experts, wait(in_flight), route)
        returning.append(all_to_all(out, route.send_splits, route.recv_splits, experts.group))
        in_flight = following
    parts = [combine(wait(back), route, top_k_weights[a:b], b - a)
             for back, route, (a, b) in zip(returning, routes, spans, strict=True)]
    return torch.cat(parts).to(hidden_states.dtype)


class MC2Dispatcher(Dispatcher):
    """Communication overlapped with expert compute (op ``ep.mc2``)."""

    name = "mc2"

    def __call__(self, module, experts, hidden_states, top_k_index, top_k_weights):
        return call_op("ep.mc2", hidden_states.device.type, module, experts, hidden_states, top_k_index,
                       top_k_weights)


class DominoDispatcher(Dispatcher):
    """``fused`` over ``experts.num_chunks`` independent token slices, each slice's all-to-alls
    overlapping the other slices' expert GEMMs, forward and backward (module ``domino``).
    With one slice there is nothing to overlap: it computes as ``fused`` does."""

    name = "domino"

    def __call__(self, module, experts, hidden_states, top_k_index, top_k_weights):
        spans, routes = chunk_routes(experts, top_k_index)

        def send(i: int) -> InFlight:
            (a, b), route = spans[i], routes[i]
            return InFlight(send_rows(hidden_states[a:b], route), route.recv_splits, route.send_splits,
                            experts.group, "dispatch", i)

        def compute(i: int, received: torch.Tensor) -> InFlight:
            route = routes[i]
            return InFlight(_grouped_compute(module, experts, received, route), route.send_splits,
                            route.recv_splits, experts.group, "combine", i)

        returned = overlap_slices(len(routes), send, compute)
        parts = [combine(back, route, top_k_weights[a:b], b - a)
                 for back, route, (a, b) in zip(returned, routes, spans, strict=True)]
        return torch.cat(parts).to(hidden_states.dtype)


DISPATCHERS: dict[str, Dispatcher] = {
    d.name: d for d in (EagerDispatcher(), FusedDispatcher(), MC2Dispatcher(), DominoDispatcher())
}
register_backends()
