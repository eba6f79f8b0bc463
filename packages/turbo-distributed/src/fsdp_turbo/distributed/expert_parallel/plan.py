"""Which modules are expert containers, checked before anything is changed or sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.patterns import TUNER_SEGMENT, match_modules
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow
from fsdp_turbo.distributed.expert_parallel.forms import ExpertAdapter, expert_adapter, expert_forms
from fsdp_turbo.distributed.expert_parallel.module import is_expert_parallel
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel


@dataclass(frozen=True)
class EPPlan(FeaturePlan):
    """The expert containers (name -> adapter), in model order, and how tokens reach them."""

    ep: int
    containers: tuple[tuple[str, ExpertAdapter], ...]
    dispatcher: str
    num_chunks: int
    gradient_divide_factor: float | None = None  # None: the dense data-parallel size
    fixed_router: bool = False  # ep_plan.fixed_router: route by position (benchmarks)
    redundant_experts: int = 0  # ep_plan.redundant_experts: replica slots per EP rank
    rebalance_every: int = 20  # ep_plan.rebalance_every: training forwards between placements

    @property
    def container_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.containers)

    def describe(self) -> tuple[PlanRow, ...]:
        fixed = (PlanRow("ep_plan.fixed_router (routed by position, not by the router)", self.container_names),)
        spare = (PlanRow(f"ep_plan.redundant_experts ({self.redundant_experts} replica slots per EP rank, "
                         f"placed by load every {self.rebalance_every} forwards)", self.container_names),)
        return (PlanRow("ep_plan.apply_modules", self.container_names), *(fixed if self.fixed_router else ()),
                *(spare if self.redundant_experts else ()))

    def estimate(self, memory: MemoryModel) -> None:
        # Each rank keeps 1/ep of the experts: dim 0 of 3-D expert weights (for a list of
        # expert MLPs, the same bytes as keeping 1/ep of the entries).
        prefixes = tuple(name + "." for name in self.container_names)
        for name, layout in memory.params.items():
            if name.startswith(prefixes) and layout.shape:
                layout.shape[0] //= self.ep


def _containers(model: nn.Module, plan: EPPlanConfig, facts: ModelFacts) -> dict[str, nn.Module]:
    if plan.apply_modules is not None:
        return match_modules(model, plan.apply_modules, field="ep_plan.apply_modules", outermost=True)
    if not facts.experts:
        raise ConfigError("model_facts.expert_modules", None, "name the expert containers, e.g. "
                          "model_facts.expert_modules=['layers.*.moe.experts'] (or ep_plan.apply_modules)",
                          reason="no module of the model matches a registered expert form")
    return {expert.name: model.get_submodule(expert.name) for expert in facts.experts}


def _check_not_wrapped(name: str) -> None:
    """A container that a tuner layer wraps (PEFT's LoRA on expert parameters) is sharded
    through its outermost wrapper, whose adapters shard with the experts (``LoraExperts``);
    converting the inner module alone would leave the adapters whole and unsharded."""
    parts = name.split(".")
    if TUNER_SEGMENT not in parts:
        return
    wrapper = ".".join(parts[: parts.index(TUNER_SEGMENT)])
    raise ConfigError("ep_plan.apply_modules", name, f"point the pattern at {wrapper!r}, the tuner layer that "
                      "wraps it (e.g. '*mlp.experts': patterns see through PEFT)",
                      reason="the module is a tuner layer's base_layer; its LoRA adapters live in the wrapper")


def resolve_ep_plan(model: nn.Module, plan: EPPlanConfig, ep_size: int, facts: ModelFacts) -> EPPlan:
    """The expert containers (``plan.apply_modules``' picks, else the model facts'), each with
    the adapter of the first registered expert form that recognises it, which checks what the
    container asks of it (:meth:`ExpertAdapter.check`). Raises
    ``ConfigError`` (the same on every rank) and never communicates."""
    matches = _containers(model, plan, facts)
    containers: list[tuple[str, ExpertAdapter]] = []
    for name, module in matches.items():
        if is_expert_parallel(module):
            raise ConfigError("ep_plan.apply_modules", name, "apply expert parallel once",
                              reason="the module is already expert-parallel")
        _check_not_wrapped(name)
        adapter = expert_adapter(module)
        if adapter is None:
            expected = "; or ".join(form.form for form in expert_forms())
            raise ConfigError("ep_plan.apply_modules", name,
                              "point the pattern at the experts container (e.g. '*mlp.experts'), or add a "
                              "form for it with register_expert_form (an ExpertAdapter subclass)",
                              reason=f"{type(module).__name__} is not an expert container: it matches no "
                                     f"registered expert form ({expected})")
        adapter.check(name, module)
        if adapter.num_experts % ep_size:
            raise ConfigError("expert_parallel_size", ep_size,
                              f"use a divisor of the number of experts ({adapter.num_experts})",
                              reason=f"{name} has {adapter.num_experts} experts")
        check_replicable(name, adapter, plan.redundant_experts, ep_size)
        containers.append((name, adapter))
    return EPPlan(ep_size, tuple(containers), plan.dispatcher, plan.num_chunks, plan.gradient_divide_factor,
                  plan.fixed_router, plan.redundant_experts, plan.rebalance_every)


def check_replicable(name: str, adapter: ExpertAdapter, spare: int, ep_size: int) -> None:
    """``ep_plan.redundant_experts`` needs other ranks' experts to copy and a form that can."""
    if not spare:
        return
    field = "ep_plan.redundant_experts"
    if ep_size == 1:
        raise ConfigError(field, spare, "set expert_parallel_size > 1, or redundant_experts: 0",
                          reason="with one EP rank every expert is already on it")
    others = adapter.num_experts - adapter.num_experts // ep_size
    if spare > others:
        raise ConfigError(field, spare, f"use at most {others} (the experts of the other EP ranks)",
                          reason=f"{name} has {adapter.num_experts} experts over {ep_size} EP ranks")
    if not adapter.replicable:
        raise ConfigError(field, spare, f"set redundant_experts: 0, or give {type(adapter).__name__} "
                          "replicable = True and home_weights()", reason=f"{name} is {adapter.form}, whose "
                          "form cannot hand its weights to replica slots")


def check_replica_weights(name: str, adapter: ExpertAdapter, module: nn.Module, spare: int) -> None:
    """Checked when the experts are converted (MX training converts them just before): a form
    that cannot hand its weights to replicas (MX-trained experts) is refused there."""
    if spare and not adapter.home_weights(module):
        raise ConfigError("ep_plan.redundant_experts", spare, "set redundant_experts: 0, or leave the experts "
                          "out of quantization_plan", reason=f"{name}'s experts are MX-trained: their GEMMs "
                          "read their weights through turbo-quant's kernels, which have no replica slots")


def _inside(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def containers_to_shard(model: nn.Module, patterns: tuple[str, ...] | None, containers: tuple[str, ...], *,
                        require_all: bool) -> tuple[str, ...]:
    """The expert containers inside the modules ``ep_plan.apply_efsdp_modules`` picks (every one
    when unset). Only they shard on the expert mesh: a router beside them in a picked ``mlp``
    must not, or its gradient would be reduced over the expert-FSDP ranks alone. With
    ``require_all`` every container must be picked: one left out would be neither sharded nor
    reduced over the expert-FSDP ranks."""
    if patterns is None:
        return containers
    field = "ep_plan.apply_efsdp_modules"
    targets = match_modules(model, patterns, field=field)
    chosen = tuple(name for name in containers if any(_inside(name, target) for target in targets))
    if not chosen:
        raise ConfigError(field, list(patterns), "pick the modules that hold the expert containers, e.g. "
                          "['model.layers.*.mlp']", reason=f"no expert container is inside {sorted(targets)}")
    missing = [name for name in containers if name not in chosen]
    if missing and require_all:
        raise ConfigError(field, list(patterns), f"add a pattern that picks {missing[0]!r} (or leave the field "
                          "unset: every expert container)", reason=f"{len(missing)} expert containers are "
                          "inside no pick; they would be neither sharded nor reduced over the expert-FSDP ranks")
    return chosen
