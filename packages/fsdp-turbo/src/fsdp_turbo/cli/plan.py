"""``fsdp-turbo plan``: a dry run on the meta device. No processes, no real memory.

It plans the job exactly as ``train`` does (the facade's own planner, every enabled
feature's plan), then prints what each plan resolved, the mesh layout (rank ->
coordinates) and the per-rank memory estimate the plans make together
(``fsdp_turbo.core.memory_estimate``). With ``--nnodes``/``--nproc-per-node`` it also shows
which node every mesh group lands on (``fsdp_turbo.core.topology``). It imports no feature
package: everything it shows comes from the plans' ``describe()`` and ``estimate()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp_turbo.cli.attention_kinds import attention_lines
from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.model import build_model
from fsdp_turbo.cli.names import compress_names
from fsdp_turbo.cli.sizes import default_world_size, job_sizes
from fsdp_turbo.core.device import detect_device_type
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.features import ignored_fields
from fsdp_turbo.core.memory_estimate import MemoryEstimate, MemoryModel
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelSizes, ParallelState
from fsdp_turbo.core.topology import NodeLayout, cross_node_warnings, placement
from fsdp_turbo.fsdp_turbo import model_facts, plan_transforms

MIB = 2**20


def node_layout(job: JobConfig, world_size: int | None, nnodes: int | None,
                nproc_per_node: int | None) -> NodeLayout | None:
    """The nodes the flags describe, or ``None`` without ``--nnodes``/``--nproc-per-node``.

    Both flags: ``N x K`` ranks, which ``--world-size`` must then match. One flag: the other
    follows from the world size (``--world-size``, else the job's sizes).
    """
    if nnodes is None and nproc_per_node is None:
        return None
    for flag, value in (("--nnodes", nnodes), ("--nproc-per-node", nproc_per_node)):
        if value is not None and value < 1:
            raise ConfigError(flag, value, "use a whole number >= 1")
    if nnodes is not None and nproc_per_node is not None:
        if world_size is not None and world_size != nnodes * nproc_per_node:
            raise ConfigError("--world-size", world_size,
                              f"drop it, or make it --nnodes x --nproc-per-node = {nnodes * nproc_per_node}",
                              reason=f"{nnodes} nodes of {nproc_per_node} ranks are {nnodes * nproc_per_node}")
        return NodeLayout(ranks_per_node=nproc_per_node, nodes=nnodes)
    world = world_size or default_world_size(job)
    flag, given = ("--nnodes", nnodes) if nnodes is not None else ("--nproc-per-node", nproc_per_node)
    if world % given:
        raise ConfigError(flag, given, f"use a divisor of the world size {world}, or give both --nnodes and "
                          "--nproc-per-node", reason=f"{world} ranks are not a whole number of nodes")
    other = world // given
    return NodeLayout(ranks_per_node=other, nodes=given) if nnodes is not None else NodeLayout(given, other)


def placement_lines(sizes: ParallelSizes, nodes: NodeLayout) -> list[str]:
    """The ``placement`` block: where each mesh group lands, then any cross-node warning."""
    per_node = nodes.ranks_per_node
    lines = [f"placement: {nodes.nodes} node{'s' if nodes.nodes > 1 else ''} x {per_node} "
             f"rank{'s' if per_node > 1 else ''} (node = rank // {per_node}, as torchrun numbers them)"]
    lines += [f"  {line}" for line in placement(sizes, nodes).describe()]
    lines += [f"  warning: {message}" for message in cross_node_warnings(sizes, nodes)]
    return lines


def facts_lines(facts: ModelFacts) -> list[str]:
    """What the model is, each fact with where it came from (detected or configured)."""
    rows = facts.rows()
    width = max(len(row.label) for row in rows)
    return ["model facts:"] + [f"  {row.label:<{width}}  {row.value}  [{row.source}]" for row in rows]


@dataclass(frozen=True)
class Planned:
    """One planned job: what ``plan`` prints, the memory estimate, and the JSON summary."""

    lines: list[str]
    memory: MemoryEstimate
    summary: dict[str, Any]
    model_memory: MemoryModel  # what the estimate was computed from


def make_plan(job: JobConfig, world_size: int | None = None, *,
              nodes: NodeLayout | None = None) -> tuple[list[str], MemoryEstimate]:
    """The plan's lines and memory estimate. Raises ``ConfigError`` as ``train`` would.
    ``nodes`` adds the placement block, and sets the world size (``nodes.world``)."""
    planned = plan_job(job, world_size, nodes=nodes)
    return planned.lines, planned.memory


def plan_job(job: JobConfig, world_size: int | None = None, *, nodes: NodeLayout | None = None,
             model: nn.Module | None = None) -> Planned:
    """``make_plan`` with the JSON summary; ``model`` (the job's, on the meta device) saves
    building it again when one search plans many layouts of the same job."""
    world = nodes.world if nodes is not None else world_size or default_world_size(job)
    sizes = job_sizes(job, world).parallel  # the accumulation is checked too, as train checks it
    model = model if model is not None else build_model(job.model, job.peft)
    # train runs every job under torchrun, so this plans for a launched job (FSDP is on
    # even at world size 1); planning communicates nothing and builds no mesh.
    state = ParallelState(sizes, rank=0, device_type=detect_device_type(job.turbo.device_type), distributed=True)
    facts = model_facts(job.turbo, model)
    planned = plan_transforms(job.turbo, model, state, facts=facts)
    tokens = job.run.micro_batch * job.data.seq_len
    # one estimate per pipeline rank (its stages); the plan shows the largest
    per_pp_rank = []
    for pp_rank in range(sizes.pp):
        estimate_model = MemoryModel.of(model, tokens, facts, device_type=state.device_type)
        estimate_model.pp_rank = pp_rank
        for _, plan in planned:
            plan.estimate(estimate_model)
        per_pp_rank.append((estimate_model, estimate_model.totals()))
    model_memory, memory = max(per_pp_rank, key=lambda pair: pair[1].peak)
    parameters = sum(p.numel() for p in model.parameters())
    lines = [f"FSDPTurbo plan: {type(model).__name__}, {parameters:,} parameters, world size {world}",
             *facts_lines(facts),
             *attention_lines(facts, [plan for _, plan in planned]),
             f"mesh: {state.describe()}",
             f"transforms, in order: {', '.join(t.name for t, _ in planned) or 'none'}",
             "ranks:  rank" + ("  pp" if sizes.pp > 1 else "") + "  dp_replicate  fsdp  cp  tp  |  edp  efsdp  ep"]
    for rank in range(world):
        coords = ParallelState(sizes, rank=rank, device_type=state.device_type, distributed=True).coordinates
        pp = f"  {coords['pp']:2d}" if sizes.pp > 1 else ""
        lines.append(f"        {rank:4d}{pp}  {coords['dp_replicate']:12d}  {coords['fsdp']:4d}  {coords['cp']:2d}  "
                     f"{coords['tp']:2d}  |  {coords['edp']:3d}  {coords['efsdp']:5d}  {coords['ep']:2d}")
    if nodes is not None:
        lines += placement_lines(sizes, nodes)
    lines.append(_weights_line(job, model_memory))
    ignored = ignored_fields(job.turbo, state)
    if ignored:
        lines.append("ignored, their features are off: " + ", ".join(ignored))
    lines.append("patterns:")
    for _, plan in planned:
        for row in (row for row in plan.describe() if not row.kind):  # kind rows: in the attention block
            lines.append(f"  {row.label}: {', '.join(compress_names(list(row.names))) if row.names else '(none)'}")
    lines += memory_lines(job, model_memory, memory)
    if sizes.pp > 1:
        lines.append("peak per pipeline rank: " + ", ".join(
            f"pp {rank} {estimate.peak / MIB:.2f} MiB" for rank, (_, estimate) in enumerate(per_pp_rank)))
    summary = {
        "model": type(model).__name__, "parameters": parameters, "world_size": world,
        "mesh": {name: getattr(sizes, name) for name in MESH_DIMS},
        "transforms": [t.name for t, _ in planned],
        "micro_batch": job.run.micro_batch, "grad_accum": job.run.grad_accum, "seq_len": job.data.seq_len,
        "tokens_per_rank": model_memory.tokens, "device_type": state.device_type,
        "memory": memory_summary(memory),
    }
    if sizes.pp > 1:
        summary["pipeline_ranks"] = [{"pp_rank": rank, **memory_summary(estimate)}
                                     for rank, (_, estimate) in enumerate(per_pp_rank)]
    return Planned(lines, memory, summary, model_memory)


MESH_DIMS = ("dp_replicate", "fsdp", "cp", "tp", "edp", "efsdp", "ep")


def memory_summary(memory: MemoryEstimate) -> dict[str, Any]:
    """The estimate as JSON: the model state, saved activations, each moment of the step and
    its transient terms, and ``peak_bytes``: the largest moment (bytes on the largest rank)."""
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer_states": memory.optimizer,
            "model_state": memory.model_state, "frozen_parameters": memory.frozen,
            "saved_activations": memory.activations, "transients": dict(memory.transients),
            "phases": dict(memory.phases), "peak_phase": memory.peak_phase, "peak_bytes": memory.peak,
            "all_gathered_per_step": memory.gathered}


def memory_lines(job: JobConfig, model_memory: MemoryModel, memory: MemoryEstimate) -> list[str]:
    on_host = "" if model_memory.optimizer_on_device else " (on the host: swap_optimizer)"
    # context parallel splits the sequences, a pipeline the batch into micro-batches
    cp = job.turbo.context_parallel_size
    split = f"; {job.data.seq_len // cp} tokens a sequence on each rank" if cp > 1 else ""
    if job.turbo.pipeline_parallel_size > 1:
        split += (f"; pipeline micro-batches of {model_memory.tokens} tokens, {model_memory.in_flight} kept at once "
                  "on the rank shown")
    lines = [
        "memory per rank (estimate):",
        f"  parameters        {memory.parameters / MIB:10.2f} MiB"
        + (f" ({(memory.parameters - memory.frozen) / MIB:.2f} trainable, {memory.frozen / MIB:.2f} frozen)"
           if memory.frozen else ""),
        f"  gradients         {memory.gradients / MIB:10.2f} MiB",
        f"  optimizer states  {memory.optimizer / MIB:10.2f} MiB{on_host}",
        f"  model state       {memory.model_state / MIB:10.2f} MiB",
        f"  activations       {memory.activations / MIB:10.2f} MiB saved per micro-batch "
        f"({job.run.micro_batch} x {job.data.seq_len} tokens{split})",
        f"  peak              {memory.peak / MIB:10.2f} MiB at {memory.peak_phase} "
        f"(one training step, {model_memory.device_type})",
        "  moments of the step: " + ", ".join(f"{name} {value / MIB:.2f}" for name, value in memory.phases.items()),
        "  transient terms: " + ", ".join(f"{name} {value / MIB:.2f}" for name, value in memory.transients.items()
                                         if value),
    ]
    if memory.gathered:
        lines.append(f"FSDP all-gathers per rank: {memory.gathered / MIB:.2f} MiB received per step "
                     "(forward and backward)")
    return lines


def _weights_line(job: JobConfig, memory: MemoryModel) -> str:
    """Where the weights come from and, for a checkpoint, what one rank reads of it."""
    path = job.model.model_name_or_path
    if path is None:
        return f"weights: init_weights(seed={job.run.seed}), the same at every layout"
    from fsdp_turbo.checkpoint.files import CheckpointFiles

    files = CheckpointFiles.open(path)
    itemsize = max(_ITEMSIZE.get(dtype, 4) for dtype in files.dtypes.values())
    read = sum(layout.numel() for layout in memory.params.values()) * itemsize
    return (f"weights: {path} ({len(set(files.files.values()))} files, {files.nbytes / MIB:,.2f} MiB); "
            f"each rank reads about {read / MIB:,.2f} MiB ({read / max(files.nbytes, 1):.0%})")


_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def print_plan(job: JobConfig, world_size: int | None = None, *, nnodes: int | None = None,
               nproc_per_node: int | None = None, as_json: bool = False) -> None:
    nodes = node_layout(job, world_size, nnodes, nproc_per_node)
    planned = plan_job(job, world_size, nodes=nodes)
    print(json.dumps(planned.summary, indent=2) if as_json else "\n".join(planned.lines))
