"""Which modules are expert containers, checked before anything is changed or sent."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.distributed.expert_parallel.experts import FORWARD_ARGS, ExpertAdapter, expert_adapter
from fsdp_turbo.distributed.expert_parallel.module import is_expert_parallel
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

_EXPECTED = (f"fused 3-D gate_up_proj/down_proj weights, or a ModuleList of expert MLPs, with "
             f"forward({', '.join(FORWARD_ARGS)})")


def resolve_ep_plan(model: nn.Module, plan: EPPlanConfig, ep_size: int) -> dict[str, ExpertAdapter]:
    """The expert containers ``plan.apply_modules`` picks, with their adapters. Raises
    ``ConfigError`` (the same on every rank) and never communicates."""
    matches = match_modules(model, plan.apply_modules, field="ep_plan.apply_modules", outermost=True)
    adapters: dict[str, ExpertAdapter] = {}
    for name, module in matches.items():
        if is_expert_parallel(module):
            raise ConfigError("ep_plan.apply_modules", name, "apply expert parallel once",
                              reason="the module is already expert-parallel")
        adapter = expert_adapter(module)
        if adapter is None:
            raise ConfigError("ep_plan.apply_modules", name,
                              "point the pattern at the experts container (e.g. '*mlp.experts')",
                              reason=f"{type(module).__name__} is not an expert container; expected {_EXPECTED}")
        if adapter.num_experts % ep_size:
            raise ConfigError("expert_parallel_size", ep_size,
                              f"use a divisor of the number of experts ({adapter.num_experts})",
                              reason=f"{name} has {adapter.num_experts} experts")
        adapters[name] = adapter
    return adapters
