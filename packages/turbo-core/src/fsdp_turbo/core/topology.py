"""Where the mesh groups land on nodes. Pure arithmetic: no process groups.

torchrun gives each node (agent) a contiguous block of ``LOCAL_WORLD_SIZE`` global ranks,
so ``node = rank // LOCAL_WORLD_SIZE``. Both meshes are row-major over the global ranks,
so the innermost dims take adjacent ranks: TP first, then CP, then the FSDP shard group,
each inside a node as far as it fits, with HSDP's ``dp_replicate`` outermost (across
nodes); in the expert mesh EP is innermost. This module makes that visible
(``fsdp-turbo plan --nnodes``) and checked (the facade warns when TP crosses nodes). It
enumerates the very groups the meshes are made of (``parallel_state.rank_groups``) rather
than reasoning about strides, so what it reports is true by construction.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import ParallelSizes, rank_groups

# Each reported group: a name, the mesh it lies on, and the mesh dims it spans. ``fsdp_cp``
# is the group FSDP shards over (``ParallelState.fsdp_mesh``), named as the flattened dim is.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dp_replicate": ("dense", ("dp_replicate",)),
    "fsdp": ("dense", ("fsdp",)),
    "cp": ("dense", ("cp",)),
    "tp": ("dense", ("tp",)),
    "fsdp_cp": ("dense", ("fsdp", "cp")),
    "edp": ("expert", ("edp",)),
    "efsdp": ("expert", ("efsdp",)),
    "ep": ("expert", ("ep",)),
}
_SHOWN_GROUPS = 8  # the detail line lists this many groups, then a count: worlds of thousands stay readable
_NAME_WIDTH = len("dp_replicate")


@dataclass(frozen=True)
class NodeLayout:
    """``nodes`` nodes of ``ranks_per_node`` ranks each, numbered as torchrun numbers them.

    Nodes are assumed homogeneous, as torch's ``DeviceMesh`` assumes (it picks a rank's
    device as ``rank % devices_per_host``). :meth:`from_env` rejects a world that is not a
    whole number of nodes; nodes of different sizes whose total happens to divide cannot be
    told from one rank's environment, and are reported as if homogeneous.
    """

    ranks_per_node: int
    nodes: int

    def __post_init__(self) -> None:
        for field in ("ranks_per_node", "nodes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(field, value, "use a whole number >= 1")

    @property
    def world(self) -> int:
        return self.ranks_per_node * self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, world_size: int | None = None) -> NodeLayout:
        """The layout torchrun launched: ``LOCAL_WORLD_SIZE`` ranks a node, ``world_size``
        (default ``WORLD_SIZE``, else 1) in all. Without ``LOCAL_WORLD_SIZE`` (not under
        torchrun) the whole world is one node."""
        environ = os.environ if environ is None else environ
        world = world_size if world_size is not None else int(environ.get("WORLD_SIZE", "1"))
        local = int(environ.get("LOCAL_WORLD_SIZE", str(world)))
        if local < 1 or world % local:
            raise ConfigError(
                "LOCAL_WORLD_SIZE", local,
                "launch the same --nproc-per-node on every node (torchrun); FSDPTurbo's meshes, like "
                "torch's DeviceMesh, assume nodes of equal size",
                reason=f"the world size {world} is not a whole number of nodes of {local} ranks")
        return cls(ranks_per_node=local, nodes=world // local)


@dataclass(frozen=True)
class GroupPlacement:
    """How the groups of one mesh dim (or flattened dims) land on nodes.

    ``groups`` are the global ranks of every group, as the mesh builds them; ``nodes[i]``
    the sorted nodes that ``groups[i]`` touches.
    """

    name: str
    groups: tuple[tuple[int, ...], ...]
    nodes: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def max_nodes(self) -> int:
        """The most nodes any one group touches."""
        return max(len(nodes) for nodes in self.nodes)

    @property
    def inside_node(self) -> bool:
        return self.max_nodes == 1

    def describe(self) -> tuple[str, ...]:
        """Two lines: where the groups lie, then the groups, gathered by the nodes they are on::

            tp           groups of 2: each inside one node
                         node 0: {0,1} {2,3}; node 1: {4,5} {6,7}
        """
        by_nodes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for group, nodes in zip(self.groups, self.nodes, strict=True):
            by_nodes.setdefault(nodes, []).append(group)
        parts, shown = [], 0
        for nodes, groups in by_nodes.items():
            if shown >= _SHOWN_GROUPS:
                break
            listed = groups[:_SHOWN_GROUPS - shown]
            shown += len(listed)
            label = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {_ranges(nodes, pairs=True)}"
            parts.append(f"{label}: " + " ".join("{" + _ranges(g) + "}" for g in listed))
        more = f"; ... {len(self.groups) - shown} more groups" if shown < len(self.groups) else ""
        return (f"{self.name:<{_NAME_WIDTH}} groups of {self.size}: {self._summary(by_nodes)}",
                " " * (_NAME_WIDTH + 1) + "; ".join(parts) + more)

    def _summary(self, by_nodes: Mapping[tuple[int, ...], list[tuple[int, ...]]]) -> str:
        if self.inside_node:
            return "each inside one node"
        if len(by_nodes) == 1:
            return f"across nodes {_ranges(next(iter(by_nodes)), pairs=True)}"
        crossing = sum(len(nodes) > 1 for nodes in self.nodes)
        if crossing < len(self.groups):
            return f"{crossing} of {len(self.groups)} across a node boundary"
        spans = {len(nodes) for nodes in self.nodes}
        return f"each across {self.max_nodes} nodes" if len(spans) == 1 else f"each across up to {self.max_nodes} nodes"


@dataclass(frozen=True)
class Placement:
    """Every mesh group's placement on ``layout``, in mesh order (dense, then expert)."""

    layout: NodeLayout
    groups: tuple[GroupPlacement, ...]

    def __getitem__(self, name: str) -> GroupPlacement:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"no mesh group {name!r}; one of {list(GROUPS)}")

    def describe(self) -> tuple[str, ...]:
        """The lines of the groups that communicate: dims of size 1 are left out, and so is
        ``fsdp_cp`` without CP (it is then ``fsdp``)."""
        lines: list[str] = []
        for group in self.groups:
            duplicate = group.name == "fsdp_cp" and group.size == self["fsdp"].size
            if group.size > 1 and not duplicate:
                lines += group.describe()
        return tuple(lines) or ("every mesh dim has size 1: nothing is communicated",)


def group_placement(sizes: ParallelSizes, layout: NodeLayout, name: str) -> GroupPlacement:
    """The placement of one group of :data:`GROUPS` (``"tp"``, ``"fsdp_cp"``, ``"ep"``, ...)."""
    if layout.world != sizes.world:
        raise ValueError(f"{layout} holds {layout.world} ranks, but the sizes are for a world of {sizes.world}")
    mesh, dims = GROUPS[name]
    dense = mesh == "dense"
    shape, names = (sizes.dense_shape, sizes.dense_dims) if dense else (sizes.expert_shape, sizes.expert_dims)
    groups = tuple(tuple(g) for g in rank_groups(shape, tuple(names.index(d) for d in dims)))
    nodes = tuple(tuple(sorted({layout.node_of(rank) for rank in group})) for group in groups)
    return GroupPlacement(name, groups, nodes)


def placement(sizes: ParallelSizes, layout: NodeLayout) -> Placement:
    """Where every mesh group of ``sizes`` lands on ``layout``."""
    return Placement(layout, tuple(group_placement(sizes, layout, name) for name in GROUPS))


def cross_node_warnings(sizes: ParallelSizes, layout: NodeLayout) -> list[str]:
    """Warnings for groups that cross nodes where that is almost always a mistake.

    Only TP: its all-reduces (or reduce-scatter/all-gather pairs with sequence parallel)
    sit on every layer's critical path, twice forward and twice backward, so they need the
    node's own links. The others are left alone on purpose: EP's all-to-alls commonly span
    nodes (that is how expert counts scale); a ring CP's K/V passes overlap with attention
    compute, and long contexts often need more ranks than a node has; FSDP's and
    dp_replicate's collectives are prefetched or overlapped with backward. Where those
    land is shown by ``fsdp-turbo plan --nnodes``, not warned about.
    """
    if layout.nodes == 1 or sizes.tp == 1:
        return []
    tp = group_placement(sizes, layout, "tp")
    if tp.inside_node:
        return []
    per_node = layout.ranks_per_node
    ranks = f"{per_node} rank" + ("s" if per_node > 1 else "")
    if sizes.tp > per_node:
        where, fix = f"spans {tp.max_nodes} nodes", f"tensor_parallel_size <= {per_node} (a divisor of it)"
    else:  # it fits a node but does not divide it, so some groups straddle two
        where, fix = "crosses node boundaries", f"a tensor_parallel_size that divides {per_node}"
    return [f"tensor_parallel_size={sizes.tp} {where} of {ranks}: TP's per-layer all-reduces would "
            f"cross the network; use {fix} and shard the rest with fully_shard_parallel_size, or launch "
            "more ranks per node"]


def launch_warnings(sizes: ParallelSizes, environ: Mapping[str, str] | None = None) -> list[str]:
    """:func:`cross_node_warnings` for the launch described by the environment (torchrun's).

    A world that is not a whole number of nodes is reported here, not raised: only the
    ranks of some nodes would see it (each node has its own ``LOCAL_WORLD_SIZE``), and an
    error on some ranks only is a hang on the rest; placement is advice, not correctness.
    """
    try:
        layout = NodeLayout.from_env(environ, world_size=sizes.world)
    except ValueError as error:  # the ConfigError above, or a LOCAL_WORLD_SIZE that is not a number
        return [f"mesh placement not checked: {error}"]
    return cross_node_warnings(sizes, layout)


def _ranges(values: tuple[int, ...], *, pairs: bool = False) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``0-3,6``; ``(0, 8, 16, 24, 32)`` -> ``0,8,...,32``, so a group
    of thousands of ranks stays one short item. Runs of two stay ``0,1`` (a group of ranks
    reads better so), unless ``pairs`` (nodes: ``across nodes 0-1``)."""
    steps = {b - a for a, b in pairwise(values)}
    if len(values) > 4 and len(steps) == 1 and steps != {1}:
        return f"{values[0]},{values[1]},...,{values[-1]}"
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    shortest = 2 if pairs else 3
    items = [f"{r[0]}-{r[-1]}" if len(r) >= shortest else ",".join(map(str, r)) for r in runs]
    return ",".join(items[:8]) + (f",... ({len(items) - 8} more)" if len(items) > 8 else "")
