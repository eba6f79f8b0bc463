"""The facade: ``model = FSDPTurbo(config, model)``.

It resolves what the model is once (:class:`ModelFacts`), plans every enabled feature
from those facts on every rank before any collective (each plan a value, made once), then
applies the plans in pipeline order, in place. The returned module is
the user's own model (same forward, attributes, parameter names and state_dict keys),
with ``model.parallel_state``, the facts (``model.fsdp_turbo_facts``) and the plans it
was given (``model.fsdp_turbo_plans``) attached.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.blueprint import guard_meta_model, has_meta_tensors, record_blueprint
from fsdp_turbo.core.device import detect_device_type, init_process_group
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.features import Feature, ignored_fields, requested_features
from fsdp_turbo.core.lm_loss import honour_ignore_index, lm_loss
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts, resolve_model_facts
from fsdp_turbo.core.module_patches import apply_module_patches
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, Transform, TransformRegistry, planning_order, registry
from fsdp_turbo.core.router_bias import RouterBiasBalancer, biased_routers, check_biased_routers
from fsdp_turbo.core.stage_part import stage_role
from fsdp_turbo.core.topology import launch_warnings
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

__all__ = ["FSDPTurbo", "ModelFacts", "Planned", "lm_loss", "model_facts", "plan_transforms"]

M = TypeVar("M", bound=nn.Module)
_log = get_logger(__name__)


def as_config(config: FSDPTurboConfig | Mapping[str, Any] | str | Path, field: str = "config") -> FSDPTurboConfig:
    """A config as ``FSDPTurbo`` takes it: a config, a dict of its fields, or a YAML/TOML path.
    ``field`` names the argument in the error for anything else."""
    if isinstance(config, FSDPTurboConfig):
        return config
    if isinstance(config, Mapping):
        return FSDPTurboConfig.from_dict(dict(config))
    if isinstance(config, str | Path):
        return FSDPTurboConfig.from_file(config)
    raise ConfigError(field, config if config is None else type(config).__name__,
                      f"pass {field}=FSDPTurboConfig(...), a dict of its fields, or the path of a YAML/TOML config")


def _world_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def _installed_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _missing_feature_error(feature: Feature, config: FSDPTurboConfig) -> ConfigError:
    installed = _installed_version(feature.package)
    if installed is None:
        fix = f"pip install {feature.package} (it provides the {feature.transform!r} transform)"
        reason = f"{feature.package} is not installed"
    else:
        fix = f"upgrade {feature.package} to a release that provides {feature.transform!r}, or turn the feature off"
        reason = f"{feature.package} {installed} is installed but has no {feature.transform!r} transform"
    return ConfigError(feature.switch, getattr(config, feature.switch), fix, reason=reason)


class Planned(NamedTuple):
    transform: Transform
    plan: FeaturePlan


def model_facts(config: FSDPTurboConfig, model: nn.Module, transforms: TransformRegistry = registry) -> ModelFacts:
    """What ``model`` is, from ``config.model_facts`` and detection. The installed transforms
    are loaded first (expert parallel registers the expert forms the facts recognise), and the
    module patches (the families' and ``config.module_patches``) applied: they change what the
    facts see."""
    transforms.all()
    apply_module_patches(model, config.module_patches)
    return resolve_model_facts(model, config.model_facts)


def plan_transforms(config: FSDPTurboConfig, model: nn.Module, state: ParallelState,
                    transforms: TransformRegistry = registry, facts: ModelFacts | None = None,
                    skip: tuple[str, ...] = ()) -> list[Planned]:
    """Plan every enabled feature from the model facts (resolved here unless given); return
    the plans in the order to apply them (``skip``: features left out). No collectives."""
    facts = facts if facts is not None else model_facts(config, model, transforms)
    for feature in requested_features(config, state):
        if transforms.get(feature.transform) is None:
            raise _missing_feature_error(feature, config)
    ignored = ignored_fields(config, state)
    if ignored:
        _log.warning("ignored, their features are off: " + ", ".join(f"{field} ({feature} is off)"
                                                                      for field, feature in ignored.items()))
    role = stage_role(model)  # a pipeline stage's part: the features with work on it
    enabled = [t for t in transforms.all() if t.is_enabled(config, state) and t.name not in skip
               and (role is None or t.on_stage(role))]
    plans: dict[str, FeaturePlan] = {}
    for transform in planning_order(enabled):
        upstream = MappingProxyType({name: plans.get(name) for name in transform.requires})
        plans[transform.name] = transform.plan(config, model, state, upstream, facts)
    return [Planned(transform, plans[transform.name]) for transform in enabled]


def _ensure_process_group(state: ParallelState, planned: list[Planned]) -> None:
    if state.distributed or (state.world_size == 1 and not any(t.name == "fully_shard" for t, _ in planned)):
        return
    # one process with an fsdp_plan: a one-rank group, no launcher needed
    options = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if state.world_size == 1 else {}
    init_process_group(state.device_type, **options)
    state.distributed = True


def FSDPTurbo(config: FSDPTurboConfig | Mapping[str, Any] | str | Path, model: M) -> M:  # noqa: N802 - seed API
    """Apply the configured parallelism, memory and quantization features to ``model``.

    Runs in a plain single process when every size is 1; under ``torchrun`` it
    initialises the process group itself if the caller has not.
    """
    config = as_config(config)
    if isinstance(getattr(model, "parallel_state", None), ParallelState):
        raise ConfigError("model", type(model).__name__, "pass the original model once; FSDPTurbo applies in place",
                          reason="this model has already been through FSDPTurbo")
    world_size, rank = _world_and_rank()
    sizes = config.validate(world_size)
    if rank == 0:  # one warning for the job, not one a rank; advice only, so it raises nothing
        for message in launch_warnings(sizes):
            _log.warning(message)
    state = ParallelState.create(sizes, rank, detect_device_type(config.device_type))
    facts = model_facts(config, model)
    experts = tuple(container.name for container in facts.experts)
    check_biased_routers(model, experts, config.router_bias_update_rate)
    planned = plan_transforms(config, model, state, facts=facts)
    record_blueprint(model)
    _ensure_process_group(state, planned)
    honour_ignore_index(model, facts.ignore_index)
    splitter = next((item for item in planned if item.transform.splits_model), None)
    if splitter is not None:
        return _pipelined(config, model, state, planned, splitter)
    for transform, plan in planned:
        _log.info(f"applying {transform.name}")
        model = transform.apply(model, plan, state)
    if config.router_bias_update_rate:
        model.fsdp_turbo_router_bias = RouterBiasBalancer(biased_routers(model, experts),
                                                          config.router_bias_update_rate)
    model.parallel_state = state
    model.fsdp_turbo_config = config
    model.fsdp_turbo_facts = facts
    model.fsdp_turbo_plans = MappingProxyType({transform.name: plan for transform, plan in planned})
    if has_meta_tensors(model):
        guard_meta_model(model)  # until load_pretrained or init_weights gives it weights
    _log.info(f"FSDPTurbo ready: {state.describe()}; transforms={[t.name for t, _ in planned]}")
    return model


def _pipelined(config: FSDPTurboConfig, model: M, state: ParallelState, planned: list[Planned],
               splitter: Planned) -> M:
    """Pipeline parallel: the whole model was planned (every check made on it), then it is
    split into this rank's stages, and every other feature is planned and applied to each
    stage as to a model of its own. The first stage is returned, with
    ``model.fsdp_turbo_pipeline`` (the runner: ``step(input_ids, labels)``, ``parameters()``)."""
    transform, plan = splitter
    parts = []
    for spec, part in transform.split(model, plan, state):
        part_facts = resolve_model_facts(part, config.model_facts)
        part_planned = plan_transforms(config, part, state, facts=part_facts, skip=(transform.name,))
        for feature, part_plan in part_planned:
            part = feature.apply(part, part_plan, state)
        part.parallel_state = state
        part.fsdp_turbo_config = config
        part.fsdp_turbo_facts = part_facts
        part.fsdp_turbo_plans = MappingProxyType({transform.name: plan, **{t.name: p for t, p in part_planned}})
        if has_meta_tensors(part):
            guard_meta_model(part)  # until load_pretrained or init_weights gives it weights
        parts.append((spec, part))
    first = parts[0][1]
    first.fsdp_turbo_pipeline = transform.join(parts, plan, state)
    _log.info(f"FSDPTurbo ready: {state.describe()}; transforms={[t.name for t, _ in planned]}")
    return first

