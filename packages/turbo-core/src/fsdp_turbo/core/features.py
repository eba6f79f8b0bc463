"""Which feature each config field asks for, and which package provides it.

This table is the one place that decides whether a built-in feature is on: the
transforms read it (``Transform.is_enabled``), and the facade reads it to name the
package to install when a config enables a feature whose transform is missing. It
reads only the config and the parallel state, never a feature package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig


@dataclass(frozen=True)
class Feature:
    transform: str
    package: str
    switch: str
    requested: Callable[[FSDPTurboConfig, ParallelState], bool]


def _launched(config: FSDPTurboConfig, state: ParallelState) -> bool:
    # Any launched job shards, even a world of one: it still gets mixed precision and offload.
    return state.world_size > 1 or state.distributed


FEATURES: tuple[Feature, ...] = (
    Feature("quantize", "turbo-quant", "quantization_plan", lambda c, s: c.quantization_plan is not None),
    Feature("tensor_parallel", "turbo-distributed", "tensor_parallel_size", lambda c, s: s.tp_size > 1),
    Feature("expert_parallel", "turbo-distributed", "expert_parallel_size", lambda c, s: s.ep_size > 1),
    Feature("context_parallel", "turbo-distributed", "context_parallel_size", lambda c, s: s.cp_size > 1),
    Feature("recompute", "turbo-memory", "recompute", lambda c, s: c.recompute),
    Feature("chunk_loss", "turbo-memory", "chunk_loss", lambda c, s: c.chunk_loss),
    Feature("swap_activation", "turbo-memory", "swap_activation", lambda c, s: c.swap_activation),
    Feature("compile", "turbo-core", "compile", lambda c, s: c.compile),
    Feature("fully_shard", "turbo-distributed", "fully_shard_parallel_size", _launched),
    Feature("swap_optimizer", "turbo-memory", "swap_optimizer", lambda c, s: c.swap_optimizer),
)


def feature_named(transform: str) -> Feature | None:
    return next((feature for feature in FEATURES if feature.transform == transform), None)


def requested_features(config: FSDPTurboConfig, state: ParallelState) -> list[Feature]:
    return [feature for feature in FEATURES if feature.requested(config, state)]
