"""Which feature each config field asks for, and which package provides it.

This table lets the facade name the package to install when a config enables a
feature whose transform is missing. It reads only the config, never a feature
package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_turbo.core.parallel_state import ParallelSizes
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig


@dataclass(frozen=True)
class Feature:
    transform: str
    package: str
    switch: str
    requested: Callable[[FSDPTurboConfig, ParallelSizes], bool]


FEATURES: tuple[Feature, ...] = (
    Feature("quantize", "turbo-quant", "quantization_plan", lambda c, s: c.quantization_plan is not None),
    Feature("tensor_parallel", "turbo-distributed", "tensor_parallel_size", lambda c, s: s.tp > 1),
    Feature("expert_parallel", "turbo-distributed", "expert_parallel_size", lambda c, s: s.ep > 1),
    Feature("context_parallel", "turbo-distributed", "context_parallel_size", lambda c, s: s.cp > 1),
    Feature("recompute", "turbo-memory", "recompute", lambda c, s: c.recompute),
    Feature("chunk_loss", "turbo-memory", "chunk_loss", lambda c, s: c.chunk_loss),
    Feature("swap_activation", "turbo-memory", "swap_activation", lambda c, s: c.swap_activation),
    Feature("compile", "turbo-core", "compile", lambda c, s: c.compile),
    Feature("fully_shard", "turbo-distributed", "fully_shard_parallel_size", lambda c, s: s.dp > 1),
    Feature("swap_optimizer", "turbo-memory", "swap_optimizer", lambda c, s: c.swap_optimizer),
)


def requested_features(config: FSDPTurboConfig, sizes: ParallelSizes) -> list[Feature]:
    return [feature for feature in FEATURES if feature.requested(config, sizes)]
