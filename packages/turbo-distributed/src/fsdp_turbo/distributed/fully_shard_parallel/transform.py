"""The FSDP2 transform: mixed precision, prefetch, ignored modules, CPU offload and HSDP."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.memory_estimate import FP32, ROOT_UNIT
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState, expert_shard_dim
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.distributed.expert_parallel.sharding import shard_experts
from fsdp_turbo.distributed.fully_shard_parallel.hook_modules import gather_at_hook_modules
from fsdp_turbo.distributed.fully_shard_parallel.policies import (
    mixed_precision_policy,
    offload_policy,
    reshard_after_forward,
)
from fsdp_turbo.distributed.fully_shard_parallel.units import prefetch_plan, select_units
from fsdp_turbo.fsdp_turbo_config import SPLIT_BACKWARD_SCHEDULES, FSDPPlanConfig, FSDPTurboConfig

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

_log = get_logger(__name__)


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _innermost_unit(parameter: str, unit_of: dict[str, str]) -> str:
    """The FSDP unit holding ``parameter``: its innermost wrapped module's, else the root's."""
    holders = [member for member in unit_of if _inside(parameter, (member,))]
    return unit_of[max(holders, key=len)] if holders else ROOT_UNIT


Prefetch = tuple[tuple[str, tuple[str, ...]], ...]  # FSDP module -> the modules it prefetches; "" is the root


@dataclass(frozen=True)
class FSDPPlan(FeaturePlan):
    """The FSDP units in model order (the root is wrapped last), the ignored modules, the
    expert containers to shard first on the expert mesh, who prefetches whom, and the
    units that keep their parameters after forward."""

    settings: FSDPPlanConfig
    units: tuple[str, ...]
    ignored: tuple[str, ...]
    experts: tuple[str, ...]
    forward_prefetch: Prefetch
    backward_prefetch: Prefetch
    shards: int  # fsdp x cp
    expert_shards: int  # efsdp
    kept: tuple[str, ...] = ()
    groups: tuple[tuple[str, ...], ...] = ()  # units of several modules (the first names the unit)
    expert_divide_factor: float | None = None  # ep_plan.gradient_divide_factor; None: the dense DP size

    def members(self, unit: str) -> tuple[str, ...]:
        return next((group for group in self.groups if group[0] == unit), (unit,))

    def describe(self) -> tuple[PlanRow, ...]:
        kept = (PlanRow("fsdp_plan.keep_after_forward", self.kept),) if self.kept else ()
        units = tuple(" + ".join(self.members(unit)) for unit in self.units)
        return (PlanRow("fsdp_plan.apply_modules", units), PlanRow("fsdp_plan.ignored_modules", self.ignored), *kept)

    def estimate(self, memory: MemoryModel) -> None:
        dtype = self.settings.param_dtype
        gather_bytes = dtype.itemsize if isinstance(dtype, torch.dtype) else FP32
        units = tuple(member for unit in self.units for member in self.members(unit))
        unit_of = {member: unit for unit in self.units for member in self.members(unit)}
        unit_of.update({name: name for name in self.experts})
        memory.backward_prefetch = max(1, self.settings.num_to_backward_prefetch)  # FSDP2 prefetches one itself
        for name, layout in memory.params.items():
            if _inside(name, self.experts):
                layout.shards = self.expert_shards
                if layout.shape:  # too few local experts: Shard(1), as expert_placement shards
                    layout.shard_dim = expert_shard_dim(layout.shape[0], layout.shards)
            elif not _inside(name, self.ignored):
                layout.shards = self.shards
            if layout.gather_bytes_per_element is None:  # MX bytes where the quantize plan set them
                layout.gather_bytes_per_element = gather_bytes
            layout.gathers = self._gathers(name, units)
            if not _inside(name, self.ignored):
                layout.unit = _innermost_unit(name, unit_of)
                layout.unsharded_bytes_per_element = gather_bytes

    def _gathers(self, parameter: str, units: tuple[str, ...]) -> int:
        """All-gathers of ``parameter`` a step: again in backward where its unit reshards after
        forward (the root, a kept unit and ``reshard_after_forward: false`` keep it)."""
        if _inside(parameter, self.experts) or _inside(parameter, units):
            kept = _inside(parameter, self.kept)
            return 2 if reshard_after_forward(self.settings, root=False) and not kept else 1
        return 2 if reshard_after_forward(self.settings, root=True) else 1


def _prefetch(units: tuple[str, ...], experts: tuple[str, ...], settings: FSDPPlanConfig,
              chunked_head: str | None) -> tuple[Prefetch, Prefetch]:
    def nested(unit: str) -> list[str]:
        # Prefetching a layer also fetches the experts inside it (their own FSDP units).
        return [name for name in experts if name.startswith(unit + ".")]

    forward, backward = [], []
    for index, ahead, behind in prefetch_plan(list(units), settings.num_to_forward_prefetch,
                                              settings.num_to_backward_prefetch):
        if ahead:
            forward.append((units[index], tuple(m for unit in ahead for m in (unit, *nested(unit)))))
        if behind:
            backward.append((units[index], tuple(m for unit in behind for m in (*nested(unit), unit))))
    if chunked_head in units:
        # A chunked-loss head computes its weight gradient in forward, so backward never needs
        # its parameters; FSDP's implicit backward prefetch (root -> the unit before it in
        # post-forward order, the head) would all-gather them for nothing. The root
        # prefetches the unit before the head instead.
        before = [unit for unit in units if unit != chunked_head]
        if before:
            backward.append(("", (before[-1],)))
    return tuple(forward), tuple(backward)


def pipeline_settings(config: FSDPTurboConfig, state: ParallelState) -> FSDPPlanConfig:
    """The FSDP settings beside a pipeline schedule that splits its backward (zbv, dualpipev).
    Its weight-gradient pass differentiates with respect to the parameters the stage holds
    when the pass starts: gathered ones only if no unit resharded after forward, so the
    units keep them (torchtitan's default under any pipeline); resharding is refused."""
    settings = config.fsdp_plan
    if state.pp_size == 1 or config.pipeline_schedule not in SPLIT_BACKWARD_SCHEDULES:
        return settings
    if settings.reshard_after_forward not in (None, False):
        raise ConfigError("fsdp_plan.reshard_after_forward", settings.reshard_after_forward,
                          "leave it unset (or false), or use pipeline_schedule '1f1b' or 'interleaved_1f1b'",
                          reason=f"pipeline_schedule {config.pipeline_schedule!r} computes weight gradients in a "
                                 "pass of its own, after FSDP would have resharded the parameters")
    return replace(settings, reshard_after_forward=False)


def plan_fully_shard(model: nn.Module, settings: FSDPPlanConfig, state: ParallelState, facts: ModelFacts, *,
                     experts: tuple[str, ...] = (), chunked_head: str | None = None,
                     expert_divide_factor: float | None = None) -> FSDPPlan:
    selection = select_units(model, settings, facts.blocks)
    units = tuple(selection.units)
    forward, backward = _prefetch(units, experts, settings, chunked_head)
    return FSDPPlan(settings, units, tuple(selection.ignored), experts, forward, backward,
                    state.fsdp_size * state.cp_size, state.efsdp_size, selection.kept,
                    tuple(selection.groups.values()), expert_divide_factor)


class FullyShardTransform(Transform):
    """``fully_shard`` each unit the plan picks (default: the repeated blocks), then the root.

    Receives the expert-parallel plan (its containers shard first, on the expert mesh)
    and the chunked-loss plan (its head is not backward-prefetched)."""

    name = "fully_shard"
    stage = Stage.FULLY_SHARD
    requires = ("expert_parallel", "chunk_loss")

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> FSDPPlan:
        experts, chunk_loss = upstream["expert_parallel"], upstream["chunk_loss"]
        return plan_fully_shard(model, pipeline_settings(config, parallel_state), parallel_state, facts,
                                experts=experts.container_names if experts is not None else (),
                                chunked_head=chunk_loss.head if chunk_loss is not None else None,
                                expert_divide_factor=experts.gradient_divide_factor if experts is not None else None)

    def apply(self, model: nn.Module, plan: FSDPPlan, parallel_state: ParallelState) -> nn.Module:
        settings = plan.settings
        ignored = {p for name in plan.ignored for p in model.get_submodule(name).parameters()} or None
        options = {
            "mesh": parallel_state.fsdp_mesh(),
            "offload_policy": offload_policy(settings, parallel_state.device_type),
            "ignored_params": ignored,
        }
        # a unit of several modules is one fully_shard call on their list
        units = [[model.get_submodule(m) for m in plan.members(name)] if len(plan.members(name)) > 1
                 else model.get_submodule(name) for name in plan.units]
        unit_kwargs = {"mp_policy": mixed_precision_policy(settings, root=False),
                       "reshard_after_forward": reshard_after_forward(settings, root=False),
                       "offload_policy": options["offload_policy"]}
        # Experts first, on their own mesh: the dense units then skip their parameters.
        experts = shard_experts({name: model.get_submodule(name) for name in plan.experts}, parallel_state,
                                plan.expert_divide_factor, **unit_kwargs)
        for name, unit in zip(plan.units, units, strict=True):
            kwargs = dict(unit_kwargs, reshard_after_forward=False) if name in plan.kept else unit_kwargs
            fully_shard(unit, **kwargs, mesh=options["mesh"], ignored_params=ignored)
        fully_shard(model, mp_policy=mixed_precision_policy(settings, root=True),
                    reshard_after_forward=reshard_after_forward(settings, root=True), **options)
        gather_at_hook_modules(model, settings.hook_modules, [*experts.values(), *(
            unit[0] if isinstance(unit, list) else unit for unit in units)])
        for name, targets in plan.forward_prefetch:
            model.get_submodule(name).set_modules_to_forward_prefetch([model.get_submodule(t) for t in targets])
        for name, targets in plan.backward_prefetch:
            model.get_submodule(name).set_modules_to_backward_prefetch([model.get_submodule(t) for t in targets])
        _log.info(f"fully_shard: {len(units)} units + root over mesh {options['mesh'].mesh.tolist()}"
                  + (f"; {len(experts)} expert units over {parallel_state.sizes.expert_shape}" if experts else ""))
        return model
