"""Where every (token, k) slot goes: the count exchange and the permutations around it.

Slots are sorted by global expert id, which also groups them by destination EP rank
(rank ``r`` owns experts ``[r * E_local, (r + 1) * E_local)``), so one
``all_to_all_single`` with uneven splits sends them. The receiver gets them source-major
(and expert-sorted within each source); ``expert_major`` reorders them so each local
expert's rows are contiguous. Slots routed to an id ``>= num_experts`` (dropped by the
router) are not sent and contribute zero, as in HF's experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TokenRoute:
    """One routing decision, shared by dispatch and combine."""

    order: torch.Tensor  # routed slots (flat token * top_k + k), sorted by expert
    send_splits: list[int]  # rows to each EP rank
    recv_splits: list[int]  # rows from each EP rank
    recv_expert: torch.Tensor  # local expert of each received row, source-major
    expert_major: torch.Tensor  # received rows -> expert-major order
    group_sizes: torch.Tensor  # rows per local expert, expert-major
    top_k: int

    @property
    def num_received(self) -> int:
        return sum(self.recv_splits)


def fixed_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ep_plan.fixed_router``: token ``t``'s ``k``-th slot goes to expert ``(t * top_k + k) mod
    num_experts`` with weight ``1 / top_k``: every expert gets the same load, within one slot."""
    slots = torch.arange(top_k_index.numel(), device=top_k_index.device).view(top_k_index.shape)
    index = (slots % num_experts).to(top_k_index.dtype)
    return index, torch.full_like(top_k_weights, 1.0 / top_k_index.shape[-1])


def count_tokens(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots sorted by expert, routed only; slots per expert ``[num_experts]``)."""
    flat = top_k_index.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    order = torch.argsort(flat, stable=True)[: int(counts.sum())]
    return order, counts


def exchange_counts(counts: torch.Tensor, ep_size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``counts [..., E]`` per chunk -> ``[ep, ..., E_local]``: what each source sends to my experts.

    One ``all_to_all_single`` of int64s for every chunk at once."""
    local = counts.shape[-1] // ep_size
    send = counts.reshape(*counts.shape[:-1], ep_size, local).movedim(-2, 0).contiguous()
    if group is None:
        return send
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def build_route(order: torch.Tensor, counts: torch.Tensor, received: torch.Tensor, top_k: int) -> TokenRoute:
    """``counts [E]`` sent by me, ``received [ep, E_local]`` sent to me."""
    ep_size, local = received.shape
    send_splits = counts.reshape(ep_size, local).sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    experts = torch.arange(local, device=received.device).repeat(ep_size)
    recv_expert = torch.repeat_interleave(experts, received.reshape(-1), output_size=sum(recv_splits))
    expert_major = torch.argsort(recv_expert, stable=True)
    return TokenRoute(order, send_splits, recv_splits, recv_expert, expert_major, received.sum(0), top_k)


def route_tokens(top_k_index: torch.Tensor, num_experts: int, ep_size: int,
                 group: dist.ProcessGroup | None) -> TokenRoute:
    """Count, exchange counts (one small collective) and build the permutations."""
    order, counts = count_tokens(top_k_index, num_experts)
    return build_route(order, counts, exchange_counts(counts, ep_size, group), top_k_index.shape[-1])


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse
