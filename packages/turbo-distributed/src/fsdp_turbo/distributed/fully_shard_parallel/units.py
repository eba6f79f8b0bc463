"""Which modules become FSDP units, which are ignored, and who prefetches whom."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig


@dataclass(frozen=True)
class ShardingUnits:
    """FSDP units in model order (the root is added last by the transform), ignored
    modules, and the units that keep their parameters gathered after forward."""

    units: dict[str, nn.Module]
    ignored: dict[str, nn.Module]
    kept: tuple[str, ...] = ()
    # a unit of several modules: its first module's name (its key in ``units``) -> all of them
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def ignored_params(self) -> set[nn.Parameter]:
        return {p for module in self.ignored.values() for p in module.parameters()}


def _inside(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def select_units(model: nn.Module, plan: FSDPPlanConfig, blocks: tuple[str, ...]) -> ShardingUnits:
    """Resolve the plan's patterns on ``model`` (no ``apply_modules``: the repeated ``blocks``);
    raises ConfigError, never communicates."""
    if plan.apply_modules is not None:
        units = match_modules(model, plan.apply_modules, field="fsdp_plan.apply_modules", outermost=True)
    else:
        units = {name: model.get_submodule(name) for name in blocks}
    groups = _unit_groups(model, plan, units)
    if groups:
        order = {name: index for index, (name, _) in enumerate(model.named_modules())}
        units = dict(sorted({**units, **{first: model.get_submodule(first) for first in groups}}.items(),
                            key=lambda item: order[item[0]]))
    ignored = (match_modules(model, plan.ignored_modules, field="fsdp_plan.ignored_modules", outermost=True)
               if plan.ignored_modules else {})
    for unit in [member for name in units for member in groups.get(name, (name,))]:
        for skip in ignored:
            if _inside(unit, skip):
                raise ConfigError("fsdp_plan.ignored_modules", skip,
                                  f"drop {unit!r} from fsdp_plan.apply_modules or {skip!r} from ignored_modules",
                                  reason=f"it contains the FSDP unit {unit!r}")
    return ShardingUnits(units, ignored, _kept_units(model, plan, units, groups), groups)


def _unit_groups(model: nn.Module, plan: FSDPPlanConfig, units: dict[str, nn.Module]) -> dict[str, tuple[str, ...]]:
    """Each group's modules by its first one's name; a module may be in one unit only."""
    groups: dict[str, tuple[str, ...]] = {}
    taken = list(units)
    for patterns in plan.unit_groups:
        names = tuple(match_modules(model, patterns, field="fsdp_plan.unit_groups", outermost=True))
        for name in names:
            clash = next((other for other in taken if _inside(name, other) or _inside(other, name)), None)
            if clash is not None:
                raise ConfigError("fsdp_plan.unit_groups", list(patterns), f"drop {clash!r} from "
                                  f"fsdp_plan.apply_modules (or from the other group), or {name!r} from this group",
                                  reason=f"{name!r} would be in two FSDP units (with {clash!r})")
        taken.extend(names)
        groups[names[0]] = names
    return groups


def _kept_units(model: nn.Module, plan: FSDPPlanConfig, units: dict[str, nn.Module],
                groups: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    if not plan.keep_after_forward:
        return ()
    unit_of = {name: unit for unit in units for name in groups.get(unit, (unit,))}
    kept = match_modules(model, plan.keep_after_forward, field="fsdp_plan.keep_after_forward", outermost=True)
    for name in kept:
        if name not in unit_of:
            raise ConfigError("fsdp_plan.keep_after_forward", name, f"add {name!r} to fsdp_plan.apply_modules, "
                              "or drop it here", reason="it is not an FSDP unit; only units reshard after forward")
    return tuple(dict.fromkeys(unit_of[name] for name in kept))


def prefetch_plan(units: list[nn.Module], forward: int, backward: int) -> list[tuple[int, list, list]]:
    """For unit i: the next ``forward`` units to all-gather in forward, and the previous
    ``backward`` units (nearest first) in backward."""
    plan = []
    for index in range(len(units)):
        ahead = units[index + 1 : index + 1 + forward]
        behind = list(reversed(units[max(0, index - backward) : index]))
        plan.append((index, ahead, behind))
    return plan
