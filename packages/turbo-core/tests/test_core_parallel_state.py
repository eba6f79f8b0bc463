"""Parallel state: coordinates by arithmetic, and real meshes on 4 gloo ranks."""

import pytest

from fsdp_turbo.core.parallel_state import ParallelState, resolve_parallel_sizes
from fsdp_turbo.core.testing import run_distributed


def _state(rank, **sizes):
    return ParallelState(resolve_parallel_sizes(world_size=8, **sizes), rank, "cpu", distributed=False)


def test_coordinates_are_row_major_with_tp_fastest():
    states = [_state(r, data_parallel_size=2, tensor_parallel_size=2) for r in range(8)]
    assert [s.tp_rank for s in states] == [0, 1] * 4
    assert [s.fsdp_rank for s in states] == [0, 0, 1, 1] * 2
    assert [s.dp_replicate_rank for s in states] == [0] * 4 + [1] * 4
    # TP peers feed the same data shard; there are dp_replicate x fsdp shards.
    assert [s.dp_rank for s in states] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {s.dp_size for s in states} == {4}


def test_cp_ranks_share_a_data_shard():
    states = [_state(r, context_parallel_size=2) for r in range(8)]
    assert [s.cp_rank for s in states] == [0, 1] * 4
    assert [s.dp_rank for s in states] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_expert_coordinates():
    states = [_state(r, expert_parallel_size=4) for r in range(8)]
    assert [s.ep_rank for s in states] == [0, 1, 2, 3] * 2
    assert states[0].efsdp_size == 2 and states[0].ep_size == 4


def test_single_process_has_no_mesh():
    state = ParallelState(resolve_parallel_sizes(world_size=1), 0, "cpu", distributed=False)
    assert (state.dp_rank, state.dp_size, state.tp_size) == (0, 1, 1)
    with pytest.raises(RuntimeError, match="no process group"):
        state.mesh("fsdp")


def _mesh_facts(dp, tp):
    import torch.distributed as dist

    sizes = resolve_parallel_sizes(world_size=dist.get_world_size(), data_parallel_size=dp,
                                   tensor_parallel_size=tp, expert_parallel_size=2)
    state = ParallelState.create(sizes, dist.get_rank(), "cpu")
    fsdp_mesh = state.fsdp_mesh()
    return {
        "tp_group": sorted(dist.get_process_group_ranks(state.group("tp"))),
        "fsdp_group": sorted(dist.get_process_group_ranks(state.group("fsdp"))),
        "dp_group": sorted(dist.get_process_group_ranks(state.group("dp_replicate", "fsdp"))),
        "ep_group": sorted(dist.get_process_group_ranks(state.group("ep"))),
        "fsdp_mesh_shape": tuple(fsdp_mesh.mesh.shape),
        "dp_rank": state.dp_rank,
    }


@pytest.mark.multirank
def test_meshes_on_four_ranks():
    facts = run_distributed(_mesh_facts, 4, 1, 2, timeout=120)
    assert [f["tp_group"] for f in facts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [f["fsdp_group"] for f in facts] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [f["ep_group"] for f in facts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [f["dp_rank"] for f in facts] == [0, 0, 1, 1]
    assert facts[0]["fsdp_mesh_shape"] == (2,)
    hsdp = run_distributed(_mesh_facts, 4, 2, 1, timeout=120)
    assert hsdp[0]["fsdp_mesh_shape"] == (2, 2)
    assert [f["dp_group"] for f in hsdp] == [[0, 1, 2, 3]] * 4


def _cp_mesh_facts():
    import torch.distributed as dist

    sizes = resolve_parallel_sizes(world_size=4, data_parallel_size=2, context_parallel_size=2)
    state = ParallelState.create(sizes, dist.get_rank(), "cpu")
    fsdp_mesh = state.fsdp_mesh()
    flat = state.flat_mesh("fsdp", "cp")
    return {
        "shape": tuple(fsdp_mesh.mesh.shape),
        "names": fsdp_mesh.mesh_dim_names,
        "shard_group": sorted(dist.get_process_group_ranks(fsdp_mesh.get_group(1))),
        "flat_is_cached": flat is state.flat_mesh("fsdp", "cp"),
    }


@pytest.mark.multirank
def test_fsdp_mesh_spans_fsdp_times_cp_under_hsdp():
    facts = run_distributed(_cp_mesh_facts, 4, timeout=120)
    assert facts[0]["shape"] == (2, 2) and facts[0]["names"] == ("dp_replicate", "fsdp_cp")
    assert [f["shard_group"] for f in facts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(f["flat_is_cached"] for f in facts)
