"""The tensor-parallel transform: DTensor styles on the TP submesh, before FSDP."""

from __future__ import annotations

from collections import Counter

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.lm_loss import set_logits_loss
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Plans, Stage, Transform
from fsdp_turbo.distributed.tensor_parallel.loss import LossParallelLossFunction, vocab_parallel_cross_entropy
from fsdp_turbo.distributed.tensor_parallel.plan import StyleKind, TiedGroup, TPPlan, build_style, resolve_tp_plan
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

_log = get_logger(__name__)


def _retie(model: nn.Module, groups: tuple[TiedGroup, ...]) -> None:
    for (first_module, first_param), *others in groups:
        shared = getattr(model.get_submodule(first_module), first_param)
        for module_name, param_name in others:
            setattr(model.get_submodule(module_name), param_name, shared)


def _loss_function_owner(model: nn.Module, head: str) -> nn.Module | None:
    """The innermost module holding ``head`` that has a ``loss_function`` of its own: the HF
    model, also under a wrapper that only forwards attribute reads to it (PEFT's PeftModel;
    setting the attribute there would not reach the model's forward)."""
    parts = head.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:depth]))
        if hasattr(type(module), "loss_function") or "loss_function" in vars(module):
            return module
    return None


def apply_tp_plan(model: nn.Module, plan: TPPlan, tp_mesh) -> nn.Module:
    """Apply a resolved plan (usable without the facade)."""
    for name, choice in plan.styles:
        parallelize_module(model.get_submodule(name), tp_mesh, build_style(choice))
    _retie(model, plan.tied)
    if plan.loss_head is not None:
        owner = _loss_function_owner(model, plan.loss_head)
        if owner is not None:
            # HF models compute the loss inside forward: make it run on the vocab shards.
            owner.loss_function = LossParallelLossFunction(owner.loss_function)
        # models that return logits: core.lm_loss runs the vocab-sharded cross-entropy
        set_logits_loss(model, vocab_parallel_cross_entropy)
    return model


def _check_expert_parallel_has_sequence_parallel(config: FSDPTurboConfig, plan: TPPlan) -> None:
    if not any(choice.kind is StyleKind.SEQUENCE_PARALLEL for _, choice in plan.styles):
        # Without sequence parallel every TP rank holds the same tokens and would send
        # them all to the experts again (Megatron requires sequence parallel here too).
        raise ConfigError("tp_plan.sequence_parallel", list(config.tp_plan.sequence_parallel),
                          "enable sequence parallel (e.g. ['*layernorm', 'model.norm']) with expert "
                          "parallel and tensor parallel together",
                          reason="expert parallel with tensor parallel needs each TP rank to hold its own tokens")


class TensorParallelTransform(Transform):
    """Colwise / rowwise Linear and Embedding, sequence-parallel norms, loss-parallel head.

    Receives the expert-parallel plan: expert containers are split by expert, not by TP,
    so TP leaves them alone, and needs sequence parallel beside them."""

    name = "tensor_parallel"
    stage = Stage.TENSOR_PARALLEL
    requires = ("expert_parallel",)

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> TPPlan:
        experts = upstream["expert_parallel"]
        plan = resolve_tp_plan(model, config.tp_plan, parallel_state.tp_size, facts,
                               exclude=experts.container_names if experts is not None else ())
        if experts is not None:
            _check_expert_parallel_has_sequence_parallel(config, plan)
        return plan

    def apply(self, model: nn.Module, plan: TPPlan, parallel_state: ParallelState) -> nn.Module:
        apply_tp_plan(model, plan, parallel_state.mesh("tp"))
        counts = Counter(choice.kind.value for _, choice in plan.styles)
        _log.info(f"tensor_parallel over {plan.tp} ranks: {dict(counts)}")
        return model
