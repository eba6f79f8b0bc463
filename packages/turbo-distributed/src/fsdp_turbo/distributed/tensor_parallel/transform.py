"""The tensor-parallel transform: DTensor styles on the TP submesh, before FSDP."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.distributed.expert_parallel.plan import resolve_ep_plan
from fsdp_turbo.distributed.tensor_parallel.loss import LossParallelLossFunction
from fsdp_turbo.distributed.tensor_parallel.plan import ResolvedTPPlan, resolve_tp_plan
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

_log = get_logger(__name__)


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    for (first_module, first_param), *others in groups:
        shared = getattr(model.get_submodule(first_module), first_param)
        for module_name, param_name in others:
            setattr(model.get_submodule(module_name), param_name, shared)


def resolve_config_tp_plan(model: nn.Module, config: FSDPTurboConfig, tp: int, ep: int) -> ResolvedTPPlan:
    """The facade's TP plan: expert-parallel containers are split by expert, not by TP,
    so with ``ep > 1`` TP leaves them alone."""
    experts = resolve_ep_plan(model, config.ep_plan, ep) if ep > 1 else {}
    return resolve_tp_plan(model, config.tp_plan, tp, exclude=experts)


def apply_tp_plan(model: nn.Module, resolved: ResolvedTPPlan, tp_mesh) -> nn.Module:
    """Apply resolved styles (usable without the facade)."""
    for name, style in resolved.styles.items():
        parallelize_module(model.get_submodule(name), tp_mesh, style)
    _retie(model, resolved.tied)
    if resolved.loss_head is not None and hasattr(model, "loss_function"):
        # HF models compute the loss inside forward: make it run on the vocab shards.
        model.loss_function = LossParallelLossFunction(model.loss_function)
    return model


class TensorParallelTransform(Transform):
    """Colwise / rowwise Linear and Embedding, sequence-parallel norms, loss-parallel head."""

    name = "tensor_parallel"
    stage = Stage.TENSOR_PARALLEL

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        return parallel_state.tp_size > 1

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        resolve_config_tp_plan(model, config, parallel_state.tp_size, parallel_state.ep_size)

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        resolved = resolve_config_tp_plan(model, config, parallel_state.tp_size, parallel_state.ep_size)
        apply_tp_plan(model, resolved, parallel_state.mesh("tp"))
        counts: dict[str, int] = {}
        for kind in resolved.kinds.values():
            counts[kind] = counts.get(kind, 0) + 1
        _log.info(f"tensor_parallel over {parallel_state.tp_size} ranks: {counts}")
        return model
