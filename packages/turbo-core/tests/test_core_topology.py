"""Mesh placement on nodes: which node every mesh group lands on, by the meshes' own
rank arithmetic, and the one warning (TP across nodes). Pure: no process group."""

import logging

import pytest
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import DENSE_DIMS, EXPERT_DIMS, ParallelState, resolve_parallel_sizes
from fsdp_turbo.core.topology import (
    GROUPS,
    NodeLayout,
    cross_node_warnings,
    launch_warnings,
    placement,
)
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

TWO_BY_FOUR = NodeLayout(ranks_per_node=4, nodes=2)


def _sizes(world=8, **sizes):
    return resolve_parallel_sizes(world_size=world, **sizes)


def test_tp_cp_inside_nodes_and_fsdp_across_them():
    found = placement(_sizes(fully_shard_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2),
                      TWO_BY_FOUR)
    assert found["tp"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert found["tp"].nodes == ((0,), (0,), (1,), (1,))
    assert found["cp"].groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert found["cp"].nodes == ((0,), (0,), (1,), (1,))
    assert found["fsdp"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert found["fsdp"].nodes == ((0, 1),) * 4
    assert found["fsdp_cp"].groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert (found["tp"].inside_node, found["cp"].inside_node, found["fsdp_cp"].max_nodes) == (True, True, 2)
    assert found.describe() == (
        "fsdp         groups of 2: across nodes 0-1",
        "             nodes 0-1: {0,4} {1,5} {2,6} {3,7}",
        "cp           groups of 2: each inside one node",
        "             node 0: {0,2} {1,3}; node 1: {4,6} {5,7}",
        "tp           groups of 2: each inside one node",
        "             node 0: {0,1} {2,3}; node 1: {4,5} {6,7}",
        "fsdp_cp      groups of 4: across nodes 0-1",
        "             nodes 0-1: {0,2,4,6} {1,3,5,7}",
        "efsdp        groups of 8: across nodes 0-1",
        "             nodes 0-1: {0-7}",
    )


def test_hsdp_shards_inside_each_node_and_replicates_across_all():
    found = placement(_sizes(data_parallel_size=4, fully_shard_parallel_size=2), NodeLayout(2, 4))
    assert found["fsdp"].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert found["fsdp"].nodes == ((0,), (1,), (2,), (3,))
    assert found["dp_replicate"].groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert found["dp_replicate"].nodes == ((0, 1, 2, 3),) * 2
    assert found["dp_replicate"].describe()[0] == "dp_replicate groups of 4: across nodes 0-3"


@pytest.mark.parametrize(("ep", "groups", "nodes"), [
    (4, ((0, 1, 2, 3), (4, 5, 6, 7)), ((0,), (1,))),
    (8, ((0, 1, 2, 3, 4, 5, 6, 7),), ((0, 1),)),
])
def test_expert_parallel_inside_a_node_or_across_two(ep, groups, nodes):
    found = placement(_sizes(expert_parallel_size=ep), TWO_BY_FOUR)["ep"]
    assert (found.groups, found.nodes) == (groups, nodes)
    assert cross_node_warnings(_sizes(expert_parallel_size=ep), TWO_BY_FOUR) == []  # EP across nodes is fine


def test_groups_are_the_meshes_own():
    # every group holds exactly the ranks whose coordinates differ only along its dims
    sizes = _sizes(16, data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2,
                   expert_parallel_size=4)
    coords = [ParallelState(sizes, r, "cpu", distributed=False).coordinates for r in range(16)]
    for name, (mesh, dims) in GROUPS.items():
        others = [d for d in (DENSE_DIMS if mesh == "dense" else EXPERT_DIMS) if d not in dims]
        for group in placement(sizes, NodeLayout(4, 4))[name].groups:
            assert len({tuple(coords[r][d] for d in others) for r in group}) == 1, (name, group)
            assert len({tuple(coords[r][d] for d in dims) for r in group}) == len(group), (name, group)
    state = ParallelState(sizes, 0, "cpu", distributed=False)
    assert [list(g) for g in placement(sizes, NodeLayout(4, 4))["cp"].groups] == state.ranks_along("cp")


def test_a_group_that_straddles_some_boundaries():
    found = placement(_sizes(12, tensor_parallel_size=4), NodeLayout(6, 2))["tp"]
    assert found.nodes == ((0,), (0, 1), (1,))
    assert found.describe() == ("tp           groups of 4: 1 of 3 across a node boundary",
                                "             node 0: {0-3}; nodes 0-1: {4-7}; node 1: {8-11}")
    [warning] = cross_node_warnings(_sizes(12, tensor_parallel_size=4), NodeLayout(6, 2))
    assert "tensor_parallel_size=4 crosses node boundaries of 6 ranks" in warning
    assert "divides 6" in warning


def test_tp_across_nodes_is_the_one_warning():
    [warning] = cross_node_warnings(_sizes(tensor_parallel_size=8), TWO_BY_FOUR)
    assert warning.startswith("tensor_parallel_size=8 spans 2 nodes of 4 ranks: TP's per-layer all-reduces "
                              "would cross the network; use tensor_parallel_size <= 4")
    assert cross_node_warnings(_sizes(tensor_parallel_size=4), TWO_BY_FOUR) == []
    # CP and FSDP across nodes are shown by the plan, not warned about
    assert cross_node_warnings(_sizes(context_parallel_size=8), TWO_BY_FOUR) == []
    assert cross_node_warnings(_sizes(tensor_parallel_size=8), NodeLayout(8, 1)) == []


def test_long_groups_stay_short():
    sizes = _sizes(4096, tensor_parallel_size=8, expert_parallel_size=64)
    lines = placement(sizes, NodeLayout(8, 512)).describe()
    assert lines[0] == "fsdp         groups of 512: across nodes 0-511"
    assert lines[1].startswith("             nodes 0-511: {0,8,...,4088} {1,9,...,4089}")
    assert max(map(len, lines)) < 300
    assert lines[3].endswith("; ... 504 more groups")


def test_sizes_of_one_communicate_nothing():
    assert placement(_sizes(1), NodeLayout(1, 1)).describe() == (
        "every mesh dim has size 1: nothing is communicated",)


def test_layout_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert NodeLayout.from_env() == TWO_BY_FOUR
    assert NodeLayout.from_env(world_size=16) == NodeLayout(4, 4)
    assert NodeLayout.from_env({"WORLD_SIZE": "8"}) == NodeLayout(8, 1)  # not under torchrun: one node
    assert NodeLayout.from_env({}) == NodeLayout(1, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert NodeLayout.from_env() == NodeLayout(8, 1)


def test_nodes_of_different_sizes_are_named_not_raised_at_launch():
    with pytest.raises(ConfigError) as info:
        NodeLayout.from_env({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    assert info.value.field == "LOCAL_WORLD_SIZE"
    assert "same --nproc-per-node on every node" in str(info.value)
    [message] = launch_warnings(_sizes(6, tensor_parallel_size=2), {"LOCAL_WORLD_SIZE": "4"})
    assert message.startswith("mesh placement not checked: LOCAL_WORLD_SIZE=4 is invalid")
    assert launch_warnings(_sizes(tensor_parallel_size=8), {"LOCAL_WORLD_SIZE": "4"})[0].startswith(
        "tensor_parallel_size=8 spans 2 nodes")
    with pytest.raises(ConfigError, match="nodes=0"):
        NodeLayout(ranks_per_node=4, nodes=0)


def test_the_facade_warns_once_on_rank_zero(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    # a tp_plan that matches nothing (or a missing turbo-distributed) stops the facade at
    # planning, after the warning and before any process group
    config = FSDPTurboConfig(tensor_parallel_size=8, fully_shard_parallel_size=1,
                             tp_plan={"colwise_parallel": ["no_such_module"]})
    for rank, expected in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_turbo"), pytest.raises(ConfigError):
            FSDPTurbo(config, nn.Sequential(nn.Linear(4, 4)))
        assert sum("TP's per-layer all-reduces" in r.getMessage() for r in caplog.records) == expected
