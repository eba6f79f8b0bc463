"""``full_tensors``: a record's DTensors gathered together, alike ones stacked into one gather,
equal bit for bit to gathering each (``full_tensor``), on 4 gloo ranks."""

import pytest
import torch

from fsdp_turbo.core.testing import full_tensor, full_tensors, run_distributed

pytestmark = pytest.mark.multirank


def _tensors() -> dict[str, torch.Tensor]:
    """FSDP2 over TP (a 2 x 2 mesh: strided shards of column-parallel weights, uneven rows),
    a row-parallel weight, Replicate, Partial, a 1-D mesh, and a plain tensor."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential()  # a module with a forward, as fully_shard requires
    for name, (inputs, outputs) in {"a": (6, 7), "b": (6, 7), "c": (7, 6), "d": (7, 6)}.items():
        model.add_module(name, nn.Linear(inputs, outputs))
    parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": ColwiseParallel(), "c": RowwiseParallel(),
                                           "d": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    tensors = dict(model.named_parameters())
    world = init_device_mesh("cpu", (4,))
    for index in range(2):
        tensors[f"replicated {index}"] = distribute_tensor(torch.randn(3, 5), mesh, [Replicate(), Replicate()])
        tensors[f"rows over the world {index}"] = distribute_tensor(torch.randn(9, 2), world, [Shard(0)])
        # a partial sum: every rank's own part, summed by the gather
        part = torch.full((2, 3), float(torch.distributed.get_rank() + index))
        tensors[f"partial {index}"] = DTensor.from_local(part, mesh, [Partial(), Shard(1)], run_check=False,
                                                         shape=torch.Size((2, 6)), stride=(6, 1))
    tensors["plain"] = torch.randn(4)
    return tensors


def _both():
    tensors = _tensors()
    placements = sorted({str(t.placements) for t in tensors.values() if hasattr(t, "placements")})
    return full_tensors(tensors), {name: full_tensor(t) for name, t in tensors.items()}, placements


def test_full_tensors_gathers_alike_tensors_together_to_the_same_bits():
    for together, each, placements in run_distributed(_both, 4, timeout=120):
        assert any("_StridedShard" in p for p in placements), placements  # FSDP over TP's layout is covered
        assert list(together) == list(each)
        for name, expected in each.items():
            assert together[name].dtype == torch.float32 and not together[name].requires_grad
            assert torch.equal(together[name], expected), name
