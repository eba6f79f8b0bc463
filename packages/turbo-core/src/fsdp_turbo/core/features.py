"""Which feature each config field asks for, and which package provides it.

This table is the one place that decides whether a built-in feature is on: the
transforms read it (``Transform.is_enabled``), and the facade reads it to name the
package to install when a config enables a feature whose transform is missing. It
reads only the config and the parallel state, never a feature package.
"""

from __future__ import annotations

import dataclasses
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


def _fully_shard(config: FSDPTurboConfig, state: ParallelState) -> bool:
    # Any launched job shards, even a world of one. So does a single process whose fsdp_plan
    # asks for something only FSDP gives (mixed precision, offload, ignored modules): the
    # facade then makes a one-rank process group, so the plan is never silently dropped.
    from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig

    return state.world_size > 1 or state.distributed or config.fsdp_plan != FSDPPlanConfig()


FEATURES: tuple[Feature, ...] = (
    Feature("pipeline_parallel", "turbo-distributed", "pipeline_parallel_size", lambda c, s: s.pp_size > 1),
    Feature("quantize", "turbo-quant", "quantization_plan", lambda c, s: c.quantization_plan is not None),
    Feature("tensor_parallel", "turbo-distributed", "tensor_parallel_size", lambda c, s: s.tp_size > 1),
    Feature("expert_parallel", "turbo-distributed", "expert_parallel_size", lambda c, s: s.ep_size > 1),
    Feature("context_parallel", "turbo-distributed", "context_parallel_size", lambda c, s: s.cp_size > 1),
    Feature("recompute", "turbo-memory", "recompute", lambda c, s: c.recompute),
    Feature("chunk_batch", "turbo-memory", "chunk_batch", lambda c, s: c.chunk_batch),
    Feature("chunk_loss", "turbo-memory", "chunk_loss", lambda c, s: c.chunk_loss),
    Feature("swap_activation", "turbo-memory", "swap_activation", lambda c, s: c.swap_activation),
    Feature("compile", "turbo-core", "compile", lambda c, s: c.compile),
    Feature("fully_shard", "turbo-distributed", "fully_shard_parallel_size", _fully_shard),
    Feature("swap_optimizer", "turbo-memory", "swap_optimizer", lambda c, s: c.swap_optimizer),
)


def feature_named(transform: str) -> Feature | None:
    return next((feature for feature in FEATURES if feature.transform == transform), None)


def requested_features(config: FSDPTurboConfig, state: ParallelState) -> list[Feature]:
    return [feature for feature in FEATURES if feature.requested(config, state)]


# The config fields that belong to one feature. When that feature is off, a field set to
# anything but its default is ignored, and named in one rank-0 warning: a config shared
# across sizes (TP on one job, off on another) still runs. A field of several features
# (swap_force) is ignored only when all of them are off. (fsdp_plan is absent: setting it
# turns FSDP on; quantization_plan is its feature's switch; model_facts serve every feature.)
FEATURE_FIELDS: dict[str, tuple[str, ...]] = {
    "pipeline_parallel": ("pipeline_schedule", "pipeline_microbatches", "pipeline_stages_per_rank",
                          "pipeline_split_points"),
    "tensor_parallel": ("tp_plan",),
    "expert_parallel": ("ep_plan", "expert_fully_shard_parallel_size"),
    "context_parallel": ("cp_plan",),
    "recompute": ("recompute_plan", "recompute_policy"),
    "chunk_batch": ("chunk_batch_plan",),
    "chunk_loss": ("chunk_loss_plan",),
    "swap_activation": ("swap_activation_plan", "swap_force"),
    "compile": ("compile_plan", "compile_backend"),
    "swap_optimizer": ("swap_force",),
}


def ignored_fields(config: FSDPTurboConfig, state: ParallelState) -> dict[str, str]:
    """Field -> the feature that is off, for every field set that its feature will not use."""
    on = {feature.transform for feature in requested_features(config, state)}
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(config)}
    used = {name for feature in on for name in FEATURE_FIELDS.get(feature, ())}
    return {name: feature for feature, names in FEATURE_FIELDS.items() if feature not in on
            for name in names if name not in used and getattr(config, name) != defaults[name]}
