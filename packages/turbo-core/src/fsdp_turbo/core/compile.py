"""Per-block ``torch.compile`` (``compile=True``): each repeated block's ``forward`` is
compiled on its own, as torchtitan does, so one compiled graph serves every layer and a
graph break stays inside one block.

Only ``forward`` is compiled, not the module call: the hooks the other transforms put on
the block (FSDP2's all-gather and reshard, recompute's checkpoint, activation swap's
saved-tensor hooks, TP's input and output redistribution on the block itself) run eagerly
around it, exactly as without compile, and the module, its names and its ``state_dict``
keys stay as they were. Compile runs after every transform that rewrites the block's
modules and before FSDP, whose hooks then wrap the compiled forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

_log = get_logger(__name__)


def check_backend(backend: str) -> None:
    """Raise ``ConfigError`` when ``torch.compile`` does not know ``backend``."""
    from torch._dynamo import list_backends

    known = set(list_backends(exclude_tags=()))
    if backend not in known:
        raise ConfigError("compile_backend", backend, f"use one of {sorted(known)}",
                          reason="torch.compile has no such backend")


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_fsdp_turbo_compiled", False)


def _check_not_compiled(name: str, module: nn.Module) -> None:
    if is_compiled(module):
        raise ConfigError("compile_plan", name, "compile each block once",
                          reason="the module's forward is already compiled")


def compile_block(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile ``module.forward`` in place (hooks stay eager); returns ``module``."""
    _check_not_compiled(type(module).__name__, module)
    module.forward = torch.compile(module.forward, backend=backend)
    module._fsdp_turbo_compiled = True
    return module


@dataclass(frozen=True)
class CompilePlan(FeaturePlan):
    blocks: tuple[str, ...]
    backend: str

    def describe(self) -> tuple[PlanRow, ...]:
        return (PlanRow("compile_plan", self.blocks),)


class CompileTransform(Transform):
    """``torch.compile`` on each block the plan picks (default: the repeated blocks)."""

    name = "compile"
    stage = Stage.COMPILE

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> CompilePlan:
        check_backend(config.compile_backend)
        blocks = facts.block_modules(model, config.compile_plan, field="compile_plan")
        for name, block in blocks.items():
            _check_not_compiled(name, block)
        return CompilePlan(tuple(blocks), config.compile_backend)

    def apply(self, model: nn.Module, plan: CompilePlan, parallel_state: ParallelState) -> nn.Module:
        for name in plan.blocks:
            compile_block(model.get_submodule(name), plan.backend)
        _log.info(f"compile: {len(plan.blocks)} blocks with backend {plan.backend!r}")
        return model
