"""Redundant experts at run time: count the load, place the replicas, fetch their weights and
route every slot to a copy (the rules are ``balance``'s).

A replica is not a parameter: each forward fetches its expert's current weights from the
home rank (one all-to-all of the rows every replica needs), differentiably, so the backward
sends each replica's weight gradient home, where autograd adds it to the expert's own.
Training is therefore the same as without replicas (up to the order of float sums), the
optimizer and checkpoints see only the home experts, and a checkpoint resumes at any layout.

When things change. The placement is recomputed at the first training forward and then
every ``rebalance_every`` training forwards, from the load counted since the last placement
(the triggering forward's included). A forward that runs inside the backward (recompute)
neither counts nor replaces: it must route as its original forward did. Evaluation forwards
use the current placement and change nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.autograd_state import in_backward
from fsdp_turbo.distributed.expert_parallel.balance import (
    EMPTY,
    Placement,
    place_replicas,
    rank_rows,
    slot_index,
    split_over_copies,
)
from fsdp_turbo.distributed.expert_parallel.collectives import all_to_all


class ExpertReplicas:
    """One expert container's replicas: its placement and the load counted towards the next."""

    def __init__(self, num_experts: int, ep: int, spare: int, rebalance_every: int,
                 group: dist.ProcessGroup, rank: int) -> None:
        self.num_experts, self.ep, self.spare = num_experts, ep, spare
        self.rebalance_every, self.group, self.rank = rebalance_every, group, rank
        self.placement: Placement | None = None
        self.load = [0] * num_experts  # tokens per expert since the last placement, every rank's
        self.counted = 0  # training forwards counted since the last placement
        self.routed_to_replicas = 0  # this rank's slots that went to a replica, every forward so far
        self.rank_rows: list[int] = [0] * ep  # rows each EP rank computed in the last forward (all sources)

    @property
    def slots(self) -> int:
        """Slot ids the dispatchers route over: ``ep * (local + spare)``."""
        return self.ep * (self.num_experts // self.ep + self.spare)

    def all_counts(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """``[ep, num_experts]``: every EP rank's routed slots per expert (one small all-gather)."""
        mine = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts + 1)[: self.num_experts]
        parts = [torch.empty_like(mine) for _ in range(self.ep)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.stack(parts)

    def update(self, counts: torch.Tensor, training: bool) -> Placement:
        """The placement this forward uses (see the module docstring for when it changes)."""
        if not training or in_backward():
            return self.placement or place_replicas(counts.sum(0).tolist(), self.ep, self.spare)
        self.load = [a + b for a, b in zip(self.load, counts.sum(0).tolist(), strict=True)]
        self.counted += 1
        if self.placement is None or self.counted >= self.rebalance_every:
            self.placement = place_replicas(self.load, self.ep, self.spare)
            self.load, self.counted = [0] * self.num_experts, 0
        return self.placement

    def route(self, top_k_index: torch.Tensor, training: bool) -> tuple[Placement, torch.Tensor]:
        """The placement and ``top_k_index`` as slot ids (``balance.slot_index``)."""
        counts = self.all_counts(top_k_index)
        placement = self.update(counts, training)
        totals = counts.sum(0).tolist()
        split = split_over_copies(totals, placement)
        slots = slot_index(top_k_index, counts, self.rank, placement, split)
        self.rank_rows = rank_rows(totals, placement, split)
        self.routed_to_replicas += int(((slots % placement.width >= placement.local)
                                        & (slots < placement.ep * placement.width)).sum())
        return placement, slots


def fetch_replicas(weights: dict[str, torch.Tensor], placement: Placement, rank: int,
                   group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """This rank's replica slots' weights, ``[spare, ...]`` per name (zeros in an EMPTY slot),
    from ``weights`` (every rank's home experts, ``[local, ...]`` per name), in one all-to-all.
    Differentiable: the backward returns each replica's gradient to its home rank's rows."""
    local, ep = placement.local, placement.ep
    names = list(weights)
    sizes = [weights[n][0].numel() for n in names]

    def wanted(by: int, home: int) -> list[tuple[int, int]]:  # (slot, expert) of rank by's replicas homed at home
        return [(j, e) for j, e in enumerate(placement.replicas[by]) if e != EMPTY and e // local == home]

    sends = [e % local for dest in range(ep) for _, e in wanted(dest, rank)]
    device = next(iter(weights.values())).device
    chosen = torch.tensor(sends, dtype=torch.long, device=device)
    outgoing = torch.cat([weights[n].reshape(local, -1)[chosen] for n in names], dim=1)
    recv_splits = [len(wanted(rank, src)) for src in range(ep)]
    send_splits = [len(wanted(dest, rank)) for dest in range(ep)]
    arrived = all_to_all(outgoing, recv_splits, send_splits, group)  # source-major, slot order within
    spare = len(placement.replicas[rank])
    filled = [j for src in range(ep) for j, _ in wanted(rank, src)]
    slots = arrived.new_zeros(spare, sum(sizes))
    if filled:
        slots = slots.index_copy(0, torch.tensor(filled, dtype=torch.long, device=device), arrived)
    parts = slots.split(sizes, dim=1)
    return {n: part.reshape(spare, *weights[n].shape[1:]) for n, part in zip(names, parts, strict=True)}


def replicas_of(module: nn.Module) -> ExpertReplicas | None:
    return getattr(module, "ep_replicas", None)
