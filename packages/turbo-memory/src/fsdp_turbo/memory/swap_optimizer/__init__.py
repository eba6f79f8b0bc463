"""Optimizer-state swap: states live in (pinned) host memory between optimizer steps."""

from fsdp_turbo.memory.swap_optimizer.swapper import OptimizerStateSwapper, SwapStats, swap_optimizer_states
from fsdp_turbo.memory.swap_optimizer.transform import SwapOptimizerTransform

__all__ = ["OptimizerStateSwapper", "SwapOptimizerTransform", "SwapStats", "swap_optimizer_states"]
