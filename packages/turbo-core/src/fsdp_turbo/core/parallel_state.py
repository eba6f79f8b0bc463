"""Parallel sizes, rank coordinates and device meshes.

Sizes and coordinates are pure arithmetic on the world size and the rank, so
they can be validated on every rank before any collective. The device meshes
(which create process groups) are built lazily, on first use, after validation.

Dense mesh ``(dp_replicate, fsdp, cp, tp)`` and expert mesh ``(edp, efsdp, ep)``
both span the whole world in row-major rank order; the expert mesh borrows the
ranks of the dense one, as torchtitan does. With pipeline parallel both meshes lead with
``pp``: each pipeline stage's ranks hold a whole dense (and expert) mesh of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from fsdp_turbo.core.errors import ConfigError

DENSE_DIMS = ("dp_replicate", "fsdp", "cp", "tp")
EXPERT_DIMS = ("edp", "efsdp", "ep")
PP_DIM = "pp"  # leads both meshes when pipeline_parallel_size > 1


@dataclass(frozen=True)
class ParallelSizes:
    world: int
    dp_replicate: int
    fsdp: int
    cp: int
    tp: int
    edp: int
    efsdp: int
    ep: int
    pp: int = 1  # pipeline stages' rank groups (the outermost dim)

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return (*self._lead, self.dp_replicate, self.fsdp, self.cp, self.tp)

    @property
    def expert_shape(self) -> tuple[int, ...]:
        return (*self._lead, self.edp, self.efsdp, self.ep)

    @property
    def dense_dims(self) -> tuple[str, ...]:
        return ((PP_DIM,) if self.pp > 1 else ()) + DENSE_DIMS

    @property
    def expert_dims(self) -> tuple[str, ...]:
        return ((PP_DIM,) if self.pp > 1 else ()) + EXPERT_DIMS

    @property
    def _lead(self) -> tuple[int, ...]:
        return (self.pp,) if self.pp > 1 else ()

    @property
    def dp_replicate_x_fsdp(self) -> int:
        """Distinct data shards: ``dp_replicate x fsdp`` (``data_parallel_size`` is the first factor only)."""
        return self.dp_replicate * self.fsdp


def resolve_parallel_sizes(
    *,
    world_size: int,
    data_parallel_size: int = 1,
    fully_shard_parallel_size: int = -1,
    context_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    expert_fully_shard_parallel_size: int | None = None,
    pipeline_parallel_size: int = 1,
) -> ParallelSizes:
    """Resolve ``-1``/``None`` sizes and check that they tile ``world_size`` exactly. With
    pipeline parallel, every other size tiles one stage's ranks (``world / pp``)."""
    if world_size < 1:
        raise ConfigError("world_size", world_size, "launch at least one process")
    pp = pipeline_parallel_size
    if world_size % pp:
        raise ConfigError("pipeline_parallel_size", pp, f"use a divisor of the world size {world_size}",
                          reason="each pipeline stage needs the same number of ranks")
    full_world, world_size = world_size, world_size // pp
    others = data_parallel_size * context_parallel_size * tensor_parallel_size
    launch = "launch with torchrun --nproc-per-node N, or change the sizes"
    if fully_shard_parallel_size == -1:
        if world_size % others:
            raise ConfigError(
                "data_parallel_size*context_parallel_size*tensor_parallel_size", others,
                f"make it divide the world size {world_size}", reason="it does not divide the world size")
        fsdp = world_size // others
    else:
        fsdp = fully_shard_parallel_size
        if others * fsdp != world_size:
            raise ConfigError(
                "fully_shard_parallel_size", fsdp,
                f"use fully_shard_parallel_size={world_size // others if world_size % others == 0 else -1} "
                f"or -1 to infer it; {launch}",
                reason=(f"data_parallel_size({data_parallel_size}) x fully_shard_parallel_size({fsdp}) x "
                        f"context_parallel_size({context_parallel_size}) x tensor_parallel_size("
                        f"{tensor_parallel_size}) = {others * fsdp}, but the world size is {world_size}"))
    ep = expert_parallel_size
    if world_size % ep:
        raise ConfigError("expert_parallel_size", ep, f"use a divisor of the world size {world_size}",
                          reason="it does not divide the world size")
    if expert_fully_shard_parallel_size is None:
        edp = math.gcd(data_parallel_size, world_size // ep)
        efsdp = world_size // (edp * ep)
    else:
        efsdp = expert_fully_shard_parallel_size
        if world_size % (efsdp * ep):
            raise ConfigError("expert_fully_shard_parallel_size", efsdp,
                              f"make expert_fully_shard_parallel_size x expert_parallel_size({ep}) divide "
                              f"the world size {world_size}, or leave it unset to derive it")
        edp = world_size // (efsdp * ep)
    return ParallelSizes(full_world, data_parallel_size, fsdp, context_parallel_size,
                         tensor_parallel_size, edp, efsdp, ep, pp)


def expert_shard_dim(local_experts: int, efsdp: int) -> int:
    """The dim expert FSDP shards a rank's experts on: 0 (whole experts per rank) when there are
    at least as many as shard ranks, else 1 (each expert's rows split)."""
    return 0 if local_experts >= efsdp else 1


def _coordinates(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def rank_groups(shape: tuple[int, ...], along: tuple[int, ...]) -> list[list[int]]:
    """Every group of global ranks that differ only along the dims at positions ``along`` of
    the row-major mesh ``shape``: the groups a (flattened) submesh over those dims spans.

    Each group is in rank order, which is the row-major order of the ``along`` dims (what
    ``DeviceMesh._flatten`` gives); groups are sorted by the coordinates of the other dims.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(math.prod(shape)):
        coords = _coordinates(rank, shape)
        key = tuple(c for i, c in enumerate(coords) if i not in along)
        groups.setdefault(key, []).append(rank)
    return [groups[key] for key in sorted(groups)]


class ParallelState:
    """Which slice of every parallel dimension this rank holds, plus its meshes.

    Build it with :meth:`create`. A world of one with no process group has no
    meshes at all: every size is 1 and every rank is 0.
    """

    def __init__(self, sizes: ParallelSizes, rank: int, device_type: str, distributed: bool) -> None:
        self.sizes = sizes
        self.rank = rank
        self.device_type = device_type
        self.distributed = distributed
        dense = dict(zip(sizes.dense_dims, _coordinates(rank, sizes.dense_shape), strict=True))
        expert = dict(zip(sizes.expert_dims, _coordinates(rank, sizes.expert_shape), strict=True))
        self.coordinates: dict[str, int] = {PP_DIM: 0, **dense, **expert}
        self._flattened: dict[str, DeviceMesh] = {}

    @classmethod
    def create(cls, sizes: ParallelSizes, rank: int, device_type: str) -> ParallelState:
        import torch.distributed as dist

        return cls(sizes, rank, device_type, distributed=dist.is_available() and dist.is_initialized())

    # ----- sizes and ranks ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.sizes.world

    @property
    def dp_size(self) -> int:
        """How many distinct data shards the job feeds (replicate x shard)."""
        return self.sizes.dp_replicate_x_fsdp

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank feeds; CP and TP peers feed the same one."""
        return self.coordinates["dp_replicate"] * self.sizes.fsdp + self.coordinates["fsdp"]

    dp_replicate_size = property(lambda self: self.sizes.dp_replicate)
    dp_replicate_rank = property(lambda self: self.coordinates["dp_replicate"])
    fsdp_size = property(lambda self: self.sizes.fsdp)
    fsdp_rank = property(lambda self: self.coordinates["fsdp"])
    cp_size = property(lambda self: self.sizes.cp)
    cp_rank = property(lambda self: self.coordinates["cp"])
    tp_size = property(lambda self: self.sizes.tp)
    tp_rank = property(lambda self: self.coordinates["tp"])
    pp_size = property(lambda self: self.sizes.pp)
    pp_rank = property(lambda self: self.coordinates[PP_DIM])
    ep_size = property(lambda self: self.sizes.ep)
    ep_rank = property(lambda self: self.coordinates["ep"])
    edp_size = property(lambda self: self.sizes.edp)
    efsdp_size = property(lambda self: self.sizes.efsdp)

    # ----- meshes -----------------------------------------------------------------------------
    @cached_property
    def dense_mesh(self) -> DeviceMesh:
        return self._init_mesh(self.sizes.dense_shape, self.sizes.dense_dims)

    @cached_property
    def expert_mesh(self) -> DeviceMesh:
        return self._init_mesh(self.sizes.expert_shape, self.sizes.expert_dims)

    def _init_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        if not self.distributed:
            raise RuntimeError("no process group is initialised, so there is no device mesh")
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, shape, mesh_dim_names=names)

    def _root_for(self, names: tuple[str, ...]) -> DeviceMesh:
        if set(names) <= set(self.sizes.dense_dims):  # 'pp' alone: the dense mesh's
            return self.dense_mesh
        if set(names) <= set(self.sizes.expert_dims):
            return self.expert_mesh
        raise KeyError(f"unknown or mixed mesh dims {names}; use dims of {DENSE_DIMS} or {EXPERT_DIMS}")

    def mesh(self, *names: str) -> DeviceMesh:
        """The submesh over ``names``, all dense or all expert dims: ``mesh('tp')``,
        ``mesh('dp_replicate', 'fsdp')``. See :meth:`flat_mesh` for a 1-D product."""
        root = self._root_for(names)
        return root[names if len(names) > 1 else names[0]]

    def flat_mesh(self, *names: str) -> DeviceMesh:
        """A 1-D mesh over the product of ``names``, e.g. ``flat_mesh('fsdp', 'cp')``.

        The flattened dim is registered on the root mesh as ``'_'.join(names)``, so it
        can be sliced together with other dims afterwards.
        """
        if len(names) == 1:
            return self.mesh(names[0])
        flat_name = "_".join(names)
        if flat_name not in self._flattened:
            self._flattened[flat_name] = self.mesh(*names)._flatten(flat_name)
        return self._flattened[flat_name]

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``fsdp`` (times ``cp``, as torchtitan does), with a
        leading ``dp_replicate`` dim for HSDP."""
        shard = "fsdp"
        if self.sizes.cp > 1:
            shard = "fsdp_cp"
            flat = self.flat_mesh("fsdp", "cp")
            if self.sizes.dp_replicate == 1:
                return flat  # torch deprecates slicing a flattened dim back out of the root
        if self.sizes.dp_replicate == 1:
            return self.dense_mesh[shard]
        return self.dense_mesh["dp_replicate", shard]

    def ranks_along(self, name: str) -> list[list[int]]:
        """Every group of global ranks that differ only along the dense dim ``name``, each in
        that dim's order: what ``mesh(name)`` spans on each rank. For sub-groups that every
        rank must create in the same order (``torch.distributed.new_group``)."""
        return rank_groups(self.sizes.dense_shape, (self.sizes.dense_dims.index(name),))

    def group(self, *names: str) -> torch.distributed.ProcessGroup:
        """The process group spanning ``names`` (flattened when several)."""
        return self.flat_mesh(*names).get_group()

    def describe(self) -> str:
        pp = f" pp={self.sizes.pp}" if self.sizes.pp > 1 else ""
        dense = " ".join(f"{n}={s}" for n, s in zip(DENSE_DIMS, self.sizes.dense_shape[-len(DENSE_DIMS):],
                                                    strict=True))
        expert = " ".join(f"{n}={s}" for n, s in zip(EXPERT_DIMS, self.sizes.expert_shape[-len(EXPERT_DIMS):],
                                                     strict=True))
        return f"world={self.world_size}{pp} [{dense}] experts[{expert}]"

    def __repr__(self) -> str:
        return f"ParallelState(rank={self.rank}, {self.describe()}, coords={self.coordinates})"
