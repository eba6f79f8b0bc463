"""Redundant experts (``ep_plan.redundant_experts``): where replicas of hot experts go, and
which copy each routed slot uses. Pure functions of integer loads, so every EP rank, given
the same all-gathered counts, computes the same answer without talking.

Slots. Each EP rank ``r`` holds ``local`` home experts (its EP shard, the parameters) and
``spare`` replica slots, ``width = local + spare`` slots in all; slot ``r * width + i`` is
home expert ``r * local + i`` for ``i < local`` and replica slot ``i - local`` otherwise. The
dispatchers route over these ``ep * width`` slots exactly as over experts: slot ids sorted
are grouped by rank, so the all-to-all, the grouped GEMMs and the combine need no change.

Placement (every ``rebalance_every`` forwards, from the load counted since the last one):
one replica at a time goes to the expert whose tokens per copy are highest (EPLB's greedy
rule), on the least-loaded rank that has a free slot and no copy of that expert yet.

Split (every forward, from this forward's counts): an expert's tokens are water-filled over
its copies' ranks, heaviest expert first, so each goes to its least-loaded copy; a source
rank's tokens of an expert then take consecutive places in the concatenation of every
source's tokens of it, and each copy serves one consecutive range of places.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY = -1  # a replica slot that holds no expert (only when every expert is on every rank)


@dataclass(frozen=True)
class Placement:
    """Which expert each replica slot holds."""

    replicas: tuple[tuple[int, ...], ...]  # [ep][spare] expert id, or EMPTY
    local: int  # home experts per EP rank

    @property
    def ep(self) -> int:
        return len(self.replicas)

    @property
    def width(self) -> int:  # slots per EP rank
        return self.local + len(self.replicas[0])

    def copies(self, expert: int) -> list[tuple[int, int]]:
        """``(rank, slot id)`` of every copy of ``expert``, the home copy first."""
        home = expert // self.local
        found = [(home, home * self.width + expert % self.local)]
        for rank, slots in enumerate(self.replicas):
            found += [(rank, rank * self.width + self.local + j) for j, e in enumerate(slots) if e == expert]
        return found


def place_replicas(load: list[int], ep: int, spare: int) -> Placement:
    """Replicas of the hottest experts over ``spare`` slots per rank (see the module docstring).
    ``load[e]``: tokens routed to expert ``e`` (global id), summed over ranks and forwards.

    One replica at a time: the expert with the most tokens per copy that some rank with a free
    slot lacks, onto the least-loaded such rank (a rank's load: its experts' tokens per copy)."""
    local = len(load) // ep
    copies = [1] * len(load)
    holds = [set(range(r * local, (r + 1) * local)) for r in range(ep)]
    slots: list[list[int]] = [[] for _ in range(ep)]

    def rank_load(rank: int) -> float:
        return sum(load[e] / copies[e] for e in holds[rank])

    for _ in range(ep * spare):
        open_ranks = [r for r in range(ep) if len(slots[r]) < spare]
        candidates = [e for e in range(len(load)) if any(e not in holds[r] for r in open_ranks)]
        if not candidates:  # every expert is already on every rank with a free slot
            break
        expert = max(candidates, key=lambda e: (load[e] / copies[e], -e))
        rank = min((r for r in open_ranks if expert not in holds[r]), key=lambda r: (rank_load(r), r))
        slots[rank].append(expert)
        holds[rank].add(expert)
        copies[expert] += 1
    return Placement(tuple(tuple(s + [EMPTY] * (spare - len(s))) for s in slots), local)


def water_fill(amount: int, loads: list[int]) -> list[int]:
    """Split ``amount`` tokens over bins already holding ``loads`` so the fullest bin is as low
    as it can be; ties go to the earlier bin. Integers, summing to ``amount``."""
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    level, used = 0.0, 0
    for used in range(1, len(order) + 1):
        below = sum(loads[i] for i in order[:used])
        level = (amount + below) / used
        if used == len(order) or level <= loads[order[used]]:
            break
    share = [0] * len(loads)
    for i in order[:used]:
        share[i] = max(0, int(level - loads[i]))
    for i in order[: amount - sum(share)]:
        share[i] += 1
    return share


def split_over_copies(totals: list[int], placement: Placement) -> dict[int, list[tuple[int, int]]]:
    """For each replicated expert: ``(slot id, tokens)`` per copy, balancing the ranks' loads."""
    local = placement.local
    replicated = {e for slots in placement.replicas for e in slots if e != EMPTY}
    rank_load = [sum(totals[e] for e in range(r * local, (r + 1) * local) if e not in replicated)
                 for r in range(placement.ep)]
    split = {}
    for expert in sorted(replicated, key=lambda e: (-totals[e], e)):
        copies = placement.copies(expert)
        shares = water_fill(totals[expert], [rank_load[rank] for rank, _ in copies])
        for (rank, _), share in zip(copies, shares, strict=True):
            rank_load[rank] += share
        split[expert] = [(slot, share) for (_, slot), share in zip(copies, shares, strict=True)]
    return split


def rank_rows(totals: list[int], placement: Placement, split: dict[int, list[tuple[int, int]]]) -> list[int]:
    """Rows each EP rank computes once ``split`` (``split_over_copies``) has spread the replicated
    experts' tokens: what the slowest rank's share of the work is measured by."""
    rows = [0] * placement.ep
    for expert, total in enumerate(totals):
        if expert not in split:
            rows[expert // placement.local] += total
    for copies in split.values():
        for slot, share in copies:
            rows[slot // placement.width] += share
    return rows


def slot_index(top_k_index: torch.Tensor, counts: torch.Tensor, source: int, placement: Placement,
               split: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """``top_k_index`` (expert ids; ``>= num_experts``: dropped) as slot ids for EP rank
    ``source``, given every rank's counts ``[ep, num_experts]`` and their ``split_over_copies``.
    Dropped slots become ``ep * width``, which no rank owns."""
    num_experts = counts.shape[1]
    local, width = placement.local, placement.width
    flat = top_k_index.reshape(-1)
    home = flat // local * width + flat % local  # every slot to its home copy
    slots = torch.where(flat < num_experts, home, placement.ep * width)
    if not split:
        return slots.view_as(top_k_index)
    # Places: this source's j-th slot of expert e is place before[e] + j among every source's.
    before = counts[:source].sum(0)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    starts = torch.searchsorted(sorted_ids, sorted_ids, right=False)  # first sorted position of each id
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts
    for expert, copies in split.items():
        mine = sorted_ids == expert
        if not mine.any():
            continue
        place = before[expert] + rank_in_expert[mine]
        ends = torch.tensor([share for _, share in copies], device=flat.device).cumsum(0)
        which = torch.searchsorted(ends, place, right=True)
        ids = torch.tensor([slot for slot, _ in copies], device=flat.device)
        slots[order[mine]] = ids[which].to(slots.dtype)
    return slots.view_as(top_k_index)
