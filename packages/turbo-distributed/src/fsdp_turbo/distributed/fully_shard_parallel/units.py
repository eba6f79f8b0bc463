"""Which modules become FSDP units, which are ignored, and who prefetches whom."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_inspect import repeated_blocks
from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig


@dataclass(frozen=True)
class ShardingUnits:
    """FSDP units in model order (the root is added last by the transform), ignored
    modules, and the units that keep their parameters gathered after forward."""

    units: dict[str, nn.Module]
    ignored: dict[str, nn.Module]
    kept: tuple[str, ...] = ()

    def ignored_params(self) -> set[nn.Parameter]:
        return {p for module in self.ignored.values() for p in module.parameters()}


def _inside(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def select_units(model: nn.Module, plan: FSDPPlanConfig) -> ShardingUnits:
    """Resolve the plan's patterns on ``model``; raises ConfigError, never communicates."""
    if plan.apply_modules is not None:
        units = match_modules(model, plan.apply_modules, field="fsdp_plan.apply_modules", outermost=True)
    else:
        units = repeated_blocks(model)
    ignored = (match_modules(model, plan.ignored_modules, field="fsdp_plan.ignored_modules", outermost=True)
               if plan.ignored_modules else {})
    for unit in units:
        for skip in ignored:
            if _inside(unit, skip):
                raise ConfigError("fsdp_plan.ignored_modules", skip,
                                  f"drop {unit!r} from fsdp_plan.apply_modules or {skip!r} from ignored_modules",
                                  reason=f"it contains the FSDP unit {unit!r}")
    return ShardingUnits(units, ignored, _kept_units(model, plan, units))


def _kept_units(model: nn.Module, plan: FSDPPlanConfig, units: dict[str, nn.Module]) -> tuple[str, ...]:
    if not plan.keep_after_forward:
        return ()
    kept = match_modules(model, plan.keep_after_forward, field="fsdp_plan.keep_after_forward", outermost=True)
    for name in kept:
        if name not in units:
            raise ConfigError("fsdp_plan.keep_after_forward", name, f"add {name!r} to fsdp_plan.apply_modules, "
                              "or drop it here", reason="it is not an FSDP unit; only units reshard after forward")
    return tuple(kept)


def prefetch_plan(units: list[nn.Module], forward: int, backward: int) -> list[tuple[int, list, list]]:
    """For unit i: the next ``forward`` units to all-gather in forward, and the previous
    ``backward`` units (nearest first) in backward."""
    plan = []
    for index in range(len(units)):
        ahead = units[index + 1 : index + 1 + forward]
        behind = list(reversed(units[max(0, index - backward) : index]))
        plan.append((index, ahead, behind))
    return plan
