"""Rank functions for the plan-as-value tests (importable by spawned ranks)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist

from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo, plan_transforms
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

# Every function that turns the config and the model into decisions: the pattern matcher,
# the model facts, and each feature's resolvers. ``apply`` must call none of them.
RESOLVERS = frozenset({
    "match_modules", "resolve_model_facts", "recognise_experts", "fused_experts_form",
    "resolve_tp_plan", "resolve_ep_plan", "expert_adapter", "resolve_cp_target", "select_units",
    "plan_fully_shard", "plan_chunked_loss", "resolve_head", "is_hf_causal_lm", "plan_conversion",
    "tensor_parallel_unsuitable", "save_ops_for", "resolve_save_ops", "context_fn_for", "check_backend",
})
BATCHES = make_token_batches(vocab_size=256, global_batch=8, seq_len=16, steps=2)


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"apply called the resolver {name}: it must use its plan")

    return refused


@contextlib.contextmanager
def resolvers_disabled() -> Iterator[int]:
    """Replace every resolver, wherever a module of ours bound its name, with one that fails."""
    saved = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("fsdp_turbo") or module is None:
            continue
        for name in RESOLVERS & set(vars(module)):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _refuse(name))
    try:
        yield len(saved)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _train(model):
    state = model.parallel_state
    return train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])


def plans_and_apply(config_dict: dict, kind: str, model_kwargs: dict) -> dict:
    """The facade's run, and a run that plans first and applies with every resolver disabled."""
    config = FSDPTurboConfig.from_dict(config_dict)
    facade = FSDPTurbo(config, tiny_hf_causal_lm(kind, **model_kwargs))

    model = tiny_hf_causal_lm(kind, **model_kwargs)
    state = ParallelState.create(config.validate(dist.get_world_size()), dist.get_rank(), "cpu")
    planned = plan_transforms(config, model, state)
    with resolvers_disabled() as disabled:
        for transform, plan in planned:
            model = transform.apply(model, plan, state)
    model.parallel_state = state
    plans = {transform.name: plan for transform, plan in planned}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, plans)
    return {"plans": plans, "facade_plans": dict(facade.fsdp_turbo_plans), "every_rank": everyone,
            "disabled": disabled, "facade": _train(facade), "planned_then_applied": _train(model)}
