"""The recompute transform: checkpoint the plan's outermost modules (default: the repeated blocks)."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_inspect import select_blocks
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.recompute.apply import apply_recompute
from fsdp_turbo.memory.recompute.policy import context_fn_for

_log = get_logger(__name__)


class RecomputeTransform(Transform):
    name = "recompute"
    stage = Stage.RECOMPUTE

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        return config.recompute

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        select_blocks(model, config.recompute_plan, field="recompute_plan")
        context_fn_for(config.recompute_policy)

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        blocks = select_blocks(model, config.recompute_plan, field="recompute_plan")
        apply_recompute(blocks.values(), config.recompute_policy)
        policy = config.recompute_policy if isinstance(config.recompute_policy, str) else "selective (custom ops)"
        _log.info(f"recompute ({policy}) on {len(blocks)} modules")
        return model
