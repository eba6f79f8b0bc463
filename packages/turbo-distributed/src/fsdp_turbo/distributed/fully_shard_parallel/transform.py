"""The FSDP2 transform: mixed precision, prefetch, ignored modules, CPU offload and HSDP."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp_turbo.core.device import has_streams
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_inspect import output_head
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.distributed.expert_parallel.sharding import nested_experts, shard_experts
from fsdp_turbo.distributed.fully_shard_parallel.units import prefetch_plan, select_units
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig, FSDPTurboConfig

_log = get_logger(__name__)


def mixed_precision_policy(plan: FSDPPlanConfig, *, root: bool) -> MixedPrecisionPolicy:
    # output_dtype is the dtype of the model's outputs: casting every unit's output would
    # hand fp32 activations to the next bf16 unit, so only the root casts.
    return MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                                output_dtype=plan.output_dtype if root else None,
                                cast_forward_inputs=plan.cast_forward_inputs)


def reshard_after_forward(plan: FSDPPlanConfig, *, root: bool) -> bool | int:
    # Unset means FSDP2's own heuristic, spelled out so every torch>=2.9 behaves alike:
    # units free their parameters after forward; the root keeps them for backward.
    if plan.reshard_after_forward is None:
        return not root
    return plan.reshard_after_forward


def offload_policy(plan: FSDPPlanConfig, device_type: str) -> OffloadPolicy:
    # Pinned host memory only helps where copies can run asynchronously.
    return CPUOffloadPolicy(pin_memory=has_streams(device_type)) if plan.cpu_offload else OffloadPolicy()


def _chunked_head_unit(model: nn.Module, config: FSDPTurboConfig, units: dict[str, nn.Module]) -> nn.Module | None:
    if not config.chunk_loss:
        return None
    name = config.chunk_loss_plan.head_module
    found = output_head(model) if name is None else (name, model.get_submodule(name))
    head = found[1] if found else None
    return head if any(unit is head for unit in units.values()) else None


def _skip_prefetching_a_chunked_head(model: nn.Module, config: FSDPTurboConfig, units: dict[str, nn.Module]) -> None:
    # A chunked-loss head computes its weight gradient in forward, so backward never needs
    # its parameters; FSDP's implicit backward prefetch (root -> the unit before it in
    # post-forward order, the head) would all-gather them for nothing. Prefetch the unit
    # before the head instead.
    head = _chunked_head_unit(model, config, units)
    if head is None:
        return
    before = [unit for unit in units.values() if unit is not head]
    if before:
        model.set_modules_to_backward_prefetch([before[-1]])


class FullyShardTransform(Transform):
    """``fully_shard`` each unit the plan picks (default: the repeated blocks), then the root."""

    name = "fully_shard"
    stage = Stage.FULLY_SHARD

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        # Any launched job shards, even a world of one (it still gets mixed precision and offload).
        return parallel_state.world_size > 1 or parallel_state.distributed

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        select_units(model, config.fsdp_plan)

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        plan = config.fsdp_plan
        selection = select_units(model, plan)
        ignored = selection.ignored_params() or None
        options = {
            "mesh": parallel_state.fsdp_mesh(),
            "offload_policy": offload_policy(plan, parallel_state.device_type),
            "ignored_params": ignored,
        }
        units = list(selection.units.values())
        unit_kwargs = {"mp_policy": mixed_precision_policy(plan, root=False),
                       "reshard_after_forward": reshard_after_forward(plan, root=False),
                       "offload_policy": options["offload_policy"]}
        # Experts first, on their own mesh: the dense units then skip their parameters.
        experts = shard_experts(model, parallel_state, **unit_kwargs)
        for unit in units:
            fully_shard(unit, **unit_kwargs, mesh=options["mesh"], ignored_params=ignored)
        fully_shard(model, mp_policy=mixed_precision_policy(plan, root=True),
                    reshard_after_forward=reshard_after_forward(plan, root=True), **options)
        for index, ahead, behind in prefetch_plan(units, plan.num_to_forward_prefetch, plan.num_to_backward_prefetch):
            # Prefetching a layer also fetches the experts inside it (their own FSDP units).
            if ahead:
                units[index].set_modules_to_forward_prefetch(
                    [m for unit in ahead for m in (unit, *nested_experts(unit, experts))])
            if behind:
                units[index].set_modules_to_backward_prefetch(
                    [m for unit in behind for m in (*nested_experts(unit, experts), unit)])
        _skip_prefetching_a_chunked_head(model, config, selection.units)
        _log.info(f"fully_shard: {len(units)} units + root over mesh {options['mesh'].mesh.tolist()}"
                  + (f"; {len(experts)} expert units over {parallel_state.sizes.expert_shape}" if experts else ""))
        return model
