"""Redundant experts' rules in one process (``expert_parallel.balance``): where the replicas go,
how an expert's tokens split over its copies, and each source's slot ids."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.distributed.expert_parallel import FusedExperts
from fsdp_turbo.distributed.expert_parallel.balance import (
    EMPTY,
    Placement,
    place_replicas,
    rank_rows,
    slot_index,
    split_over_copies,
    water_fill,
)


def test_replicas_go_to_the_hottest_experts_on_the_least_loaded_ranks():
    load = [800, 50, 50, 50, 20, 10, 10, 10]  # 2 home experts per rank over 4 ranks
    placement = place_replicas(load, ep=4, spare=1)
    assert placement.local == 2 and placement.width == 3
    # Expert 0 (800 tokens, home rank 0) is copied to ranks 3, 2 and 1 (least loaded first),
    # so each copy serves 200; rank 0's slot then takes the hottest expert it lacks (2; 1 is home).
    assert placement.replicas == ((2,), (0,), (0,), (0,))
    assert [rank for rank, _ in placement.copies(0)] == [0, 1, 2, 3]
    assert place_replicas(load, ep=4, spare=0).replicas == ((),) * 4


def test_every_expert_everywhere_leaves_slots_empty():
    placement = place_replicas([5, 5, 5, 5], ep=2, spare=2)  # 2 experts per rank: 2 others to copy
    assert sorted(e for slots in placement.replicas for e in slots) == [0, 1, 2, 3]
    placement = Placement(((2, EMPTY), (EMPTY, EMPTY)), local=2)
    assert placement.copies(2) == [(1, 1 * 4 + 0), (0, 2)]


def test_water_fill_levels_the_bins():
    assert water_fill(10, [0, 0]) == [5, 5]
    assert water_fill(10, [8, 0]) == [1, 9]  # both end at 9
    assert water_fill(3, [0, 10, 10]) == [3, 0, 0]
    assert water_fill(7, [1, 1, 1]) == [3, 2, 2]  # the remainder to the earlier bins
    assert water_fill(0, [4, 2]) == [0, 0]
    for amount, loads in [(13, [5, 2, 9]), (1, [0, 0, 0]), (100, [33, 1, 50, 7])]:
        shares = water_fill(amount, loads)
        assert sum(shares) == amount and min(shares) >= 0


def test_split_balances_the_ranks():
    placement = Placement(((EMPTY,), (0,)), local=2)  # expert 0 (home rank 0) has a copy on rank 1
    totals = [100, 20, 30, 10]  # rank 0 also holds expert 1 (20); rank 1 holds 2 and 3 (40)
    split = split_over_copies(totals, placement)
    assert split == {0: [(0, 60), (5, 40)]}  # slot 5: rank 1's replica slot; both ranks end at 80
    assert rank_rows(totals, placement, split) == [80, 80]
    assert split_over_copies(totals, Placement(((EMPTY,), (EMPTY,)), local=2)) == {}


def test_slot_ids_cover_each_copy_its_quota():
    placement = Placement(((3,), (0,)), local=2)  # width 3: rank 0 slots 0-2, rank 1 slots 3-5
    index = [torch.tensor([[0, 1], [0, 3], [0, 4], [3, 0]]), torch.tensor([[0, 2], [3, 0], [0, 3], [1, 0]])]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=5)[:4] for i in index])
    split = split_over_copies(counts.sum(0).tolist(), placement)
    slots = [slot_index(i, counts, rank, placement, split) for rank, i in enumerate(index)]
    served = torch.bincount(torch.cat([s.reshape(-1) for s in slots]), minlength=7)
    assert rank_rows(counts.sum(0).tolist(), placement, split) == [int(served[:3].sum()), int(served[3:6].sum())]
    for copies in split.values():
        for slot, share in copies:
            assert served[slot] == share
    # Unreplicated experts go home (expert 1 -> slot 1, 2 -> slot 3); a dropped slot (4) -> 2 * 3.
    assert slots[0][0, 1] == 1 and slots[1][0, 1] == 3 and slots[0][2, 1] == 6
    # Each copy keeps its expert: home or replica slot of the same id.
    ids = {0: {0, 5}, 3: {4, 2}, 1: {1}, 2: {3}}
    for i, s in zip(index, slots, strict=True):
        for expert, slot in zip(i.reshape(-1).tolist(), s.reshape(-1).tolist(), strict=True):
            assert expert == 4 or slot in ids[expert]


@dataclass(frozen=True)
class Unreplicable(FusedExperts):
    replicable: ClassVar[bool] = False


def _resolve(spare, ep, expert_lists=False, quantized=False, form=None):
    from fsdp_turbo.core.model_facts import plain_api_facts
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm, to_expert_lists
    from fsdp_turbo.distributed.expert_parallel.plan import check_replica_weights, check_replicable, resolve_ep_plan
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    model = tiny_hf_causal_lm("qwen3_moe")
    model = to_expert_lists(model) if expert_lists else model
    plan = resolve_ep_plan(model, EPPlanConfig(redundant_experts=spare), ep, plain_api_facts(model))
    for name, adapter in plan.containers:
        if form is not None:  # a form whose adapter cannot feed replicas
            check_replicable(name, form(adapter.num_experts), spare, ep)
        container = model.get_submodule(name)
        if quantized:  # what turbo-quant's MX training leaves on the experts it converts
            container.mx_recipe = "mxfp8"
        check_replica_weights(name, adapter, container, spare)
    return plan


@pytest.mark.parametrize("spare, ep, options, fix", [
    (1, 1, {}, "expert_parallel_size > 1"),
    (7, 2, {}, "at most 4"),  # 8 experts over 2 ranks: 4 on the other rank to copy
    (1, 2, {"expert_lists": True, "form": Unreplicable}, "replicable = True"),
    (1, 2, {"quantized": True}, "quantization_plan"),
])
def test_redundant_experts_that_cannot_be_honoured_are_refused(spare, ep, options, fix):
    with pytest.raises(ConfigError) as raised:
        _resolve(spare, ep, **options)
    assert raised.value.field == "ep_plan.redundant_experts" and fix in str(raised.value)


def test_the_plan_names_the_replicas():
    plan = _resolve(4, 2)
    assert plan.redundant_experts == 4
    assert any("4 replica slots per EP rank" in row.label for row in plan.describe())
