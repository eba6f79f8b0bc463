"""The context-parallel transform: Ulysses attention plus input splitting and the CP loss."""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.hf import register_attention_function, register_attention_mask
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import ModelFacts, plain_api_facts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Plans, Stage, Transform
from fsdp_turbo.distributed.context_parallel.context import CPState
from fsdp_turbo.distributed.context_parallel.inputs import InputNames, install_input_splitter
from fsdp_turbo.distributed.context_parallel.linear_attention import (
    LinearAttentionLayer,
    check_linear_heads,
    find_linear_attention,
    install_linear_attention,
    refuse_ring,
)
from fsdp_turbo.distributed.context_parallel.loss import install_loss_sum
from fsdp_turbo.distributed.context_parallel.plan import (
    CPPlan,
    CPTarget,
    check_head_split,
    layer_specs,
    refuse_unknown_kinds,
    resolve_cp_target,
)
from fsdp_turbo.distributed.context_parallel.ring import ring_core, ring_hf_attention, ring_sdpa
from fsdp_turbo.distributed.context_parallel.sparse import install_compressors, install_indexers
from fsdp_turbo.distributed.context_parallel.ulysses import ulysses_core_attention, ulysses_hf_attention
from fsdp_turbo.fsdp_turbo_config import CPPlanConfig, FSDPTurboConfig

_log = get_logger(__name__)
_names = itertools.count()


def _install_hf(model: nn.Module, state: CPState, implementation: str, model_mask: bool) -> str:
    # One registered name per model: the wrapper closes over that model's CP group.
    name = f"fsdp_turbo_{state.mode}_{next(_names)}_{implementation}"
    if state.mode == "ulysses":
        wrapper = ulysses_hf_attention(state, implementation)
    elif state.ulysses_size > 1:  # hybrid, or Ulysses x KV all-gather
        wrapper = ulysses_hf_attention(state, implementation, core=ring_core(state))
    else:
        wrapper = ring_hf_attention(state)
    register_attention_function(name, wrapper)
    if model_mask:  # the model reads its own mask beside the attention (an indexer, a compressor's entries)
        register_attention_mask(name, like="eager")
    model.config._attn_implementation = name
    return name


def _core_wrapper(state: CPState, inner: Callable[..., Any]) -> Callable[..., Any]:
    """A non-HF core attention under CP: Ulysses runs ``inner``; ring, hybrid and KV all-gather
    replace it."""
    if state.mode == "ulysses":
        return ulysses_core_attention(state, inner)
    if state.ulysses_size > 1:
        return ulysses_core_attention(state, ring_sdpa(state, count_calls=False))
    return ring_sdpa(state)


def _install_function(target: CPTarget, state: CPState) -> str:
    module_name, _, attr = target.function_path.rpartition(".")
    setattr(importlib.import_module(module_name), attr, _core_wrapper(state, target.function))
    return target.function_path


def _install_modules(model: nn.Module, target: CPTarget, state: CPState) -> str:
    # The instance's forward, not its class's: other instances of the class stay as they are.
    for name in target.module_names:
        module = model.get_submodule(name)
        module.forward = _core_wrapper(state, module.forward)
    return target.describe()


def _hybrid_groups(cp_groups: list[list[int]], ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (Ulysses, ring) groups. Every rank creates every group, in one order, as
    ``new_group`` requires: within each CP group, Ulysses over consecutive CP ranks and the
    ring (or KV all-gather) across them."""
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for ranks in cp_groups:
        inner = [ranks[o:o + ulysses] for o in range(0, len(ranks), ulysses)]
        outer = [ranks[i::ulysses] for i in range(ulysses)]
        for kind, groups in (("ulysses", inner), ("ring", outer)):
            for members in groups:
                group = dist.new_group(members)
                if me in members:
                    mine[kind] = group
    return mine["ulysses"], mine["ring"]


def apply_cp_plan(model: nn.Module, plan: CPPlan, cp_mesh, cp_groups: list[list[int]] | None = None) -> CPState:
    """Install CP as planned; ``cp_mesh`` is the 1-D CP mesh; ``cp_groups`` every CP group's
    global ranks (Ulysses inside a ring or KV all-gather only: it makes sub-groups of each)."""
    target = plan.target
    extra = {}
    if plan.nested:
        ulysses_group, ring_group = _hybrid_groups(cp_groups, plan.ulysses_size)
        rank = cp_mesh.get_local_rank()
        extra = {"ulysses_group": ulysses_group, "ulysses_size": plan.ulysses_size, "ring_group": ring_group,
                 "ring_size": plan.size // plan.ulysses_size, "ring_rank": rank // plan.ulysses_size}
    state = CPState(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(),
                    attention_layers=plan.attention_layers, mode=plan.mode, load_balance=plan.load_balance,
                    block_size=plan.block_size,
                    linear_layers=len(plan.linear_layers),
                    layers={model.get_submodule(spec.name): spec for spec in plan.layers}, **extra)
    if target.hf_implementation:
        where = _install_hf(model, state, target.hf_implementation,
                            model_mask=bool(plan.indexers or plan.compressors))
    elif target.module_names:
        where = _install_modules(model, target, state)
    else:
        where = _install_function(target, state)
    install_linear_attention(model, plan.linear_layers, state)
    install_indexers(model, plan.indexers, state)
    install_compressors(model, plan.compressors, state)
    install_input_splitter(model, state, plan.inputs)
    install_loss_sum(model, state.group, state.size)
    model.context_parallel_state = state
    outer = {"ring": "a ring", "hybrid": "a ring", "kv_allgather": "a KV all-gather"}.get(plan.mode)
    how = ("Ulysses" if outer is None else
           f"Ulysses over {plan.ulysses_size} inside {outer} of {plan.size // plan.ulysses_size}" if plan.nested else
           outer)
    _log.info(f"context_parallel over {state.size} ranks: {how} around {where}")
    return state


def plan_context_parallel(model: nn.Module, plan: CPPlanConfig | None, size: int, facts: ModelFacts, *,
                          tp: int = 1) -> CPPlan:
    """What CP over ``size`` ranks (beside ``tp`` tensor-parallel ones) would wrap; raises
    ``ConfigError``, never communicates."""
    plan = plan or CPPlanConfig()
    refuse_unknown_kinds(facts, plan.mode)
    linear = find_linear_attention(facts)
    refuse_ring(linear, plan.mode)  # first: no other fix helps a ring here
    _check_linear_attention(model, linear, size, tp)
    if plan.nested and (size % plan.ulysses_size or plan.ulysses_size >= size):
        outer = "a ring" if plan.mode == "hybrid" else "a KV all-gather"
        raise ConfigError("cp_plan.ulysses_size", plan.ulysses_size,
                          f"use a divisor of context_parallel_size={size} below it (2 .. {size // 2})",
                          reason=f"{plan.mode} runs Ulysses over ulysses_size ranks inside {outer} of the rest")
    check_head_split(facts, size, tp, plan)
    target = resolve_cp_target(model, plan, facts)
    # the wrapper knows an HF attention's module by the call (its first argument)
    layers = layer_specs(facts) if target.hf_implementation else ()
    _refuse_chunks_under_flash(layers, target, plan.mode)
    return CPPlan(size, target, len(layers) or _attention_layers(target, facts, linear), mode=plan.mode,
                  load_balance=plan.load_balance, ulysses_size=plan.ulysses_size or 0, block_size=plan.block_size,
                  inputs=InputNames(facts.token_input, facts.position_input, facts.ignore_index), linear_layers=linear,
                  layers=layers, **_sparse_parts(facts, target))


def _sparse_parts(facts: ModelFacts, target: CPTarget) -> dict[str, tuple[str, ...]]:
    """The indexers (of sparse layers) and compressors (of compressed layers) CP takes over. The
    compressed layers' own indexers belong to their compressors, which run whole."""
    if not target.hf_implementation:
        return {"indexers": (), "compressors": ()}
    compressors = facts.compressors
    indexers = tuple(name for name in facts.indexers if not any(name.startswith(c + ".") for c in compressors))
    return {"indexers": indexers, "compressors": compressors}


def _refuse_chunks_under_flash(layers: tuple, target: CPTarget, mode: str) -> None:
    """A flash kernel takes a window but no mask, so Ulysses could not keep a chunked layer's
    queries inside their blocks (ring, hybrid and KV all-gather compute their own tiles and can)."""
    chunked = [spec for spec in layers if spec.chunk]
    if chunked and mode == "ulysses" and (target.hf_implementation or "").startswith("flash"):
        raise ConfigError("model.config._attn_implementation", target.hf_implementation,
                          "load the model with attn_implementation 'sdpa' (or 'eager'), or use cp_plan.mode: ring",
                          reason=f"{chunked[0].name} attends within blocks of {chunked[0].chunk} positions, which "
                                 "a flash kernel under Ulysses cannot mask")


def _check_linear_attention(model: nn.Module, linear: tuple[LinearAttentionLayer, ...], size: int, tp: int) -> None:
    if not linear:
        return
    if tp > 1:
        raise ConfigError("tensor_parallel_size", tp, "use tensor_parallel_size=1 with context parallel on this model",
                          reason=f"context parallel runs {linear[0].name} ({len(linear)} linear-attention layers) "
                                 "with an all-to-all of its own over the CP group, which is not composed with "
                                 "tensor parallel's whole-module style yet")
    check_linear_heads(model, linear, size)


def _attention_layers(target: CPTarget, facts: ModelFacts, linear: tuple[LinearAttentionLayer, ...]) -> int:
    """How many softmax attentions the wrapper must run in each forward (0: unchecked).
    Named attention modules each run once; otherwise every repeated block (decoder layer)
    has one, except the blocks whose token mixer is a linear attention; a model without
    such blocks at least one."""
    if target.layers:
        return target.layers
    if not facts.blocks:
        return 1
    linear_blocks = [b for b in facts.blocks if any(layer.name.startswith(b + ".") for layer in linear)]
    return len(facts.blocks) - len(linear_blocks)


def apply_context_parallel(model: nn.Module, plan: CPPlanConfig | None, cp_mesh,
                           facts: ModelFacts | None = None) -> CPState:
    """Context parallel without the facade: resolve ``plan`` on ``model``, then install.
    ``facts`` default to what the model says of itself. Hybrid needs ``cp_mesh`` to span the
    world (its sub-groups are made from it)."""
    facts = facts if facts is not None else plain_api_facts(model)
    resolved = plan_context_parallel(model, plan, cp_mesh.size(), facts)
    groups = None
    if resolved.nested:
        ranks = cp_mesh.mesh.flatten().tolist()
        if len(ranks) != dist.get_world_size():
            raise ConfigError("cp_plan.mode", resolved.mode, "use FSDPTurbo for Ulysses inside a ring or KV all-gather "
                              "inside a larger mesh",
                              reason="apply_context_parallel makes the Ulysses sub-groups only of a world-wide CP mesh")
        groups = [ranks]
    return apply_cp_plan(model, resolved, cp_mesh, groups)


class ContextParallelTransform(Transform):
    """Ulysses: attention on all of the sequence for heads/cp heads; the rest stays local."""

    name = "context_parallel"
    stage = Stage.CONTEXT_PARALLEL

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> CPPlan:
        return plan_context_parallel(model, config.cp_plan, parallel_state.cp_size, facts,
                                     tp=parallel_state.tp_size)

    def apply(self, model: nn.Module, plan: CPPlan, parallel_state: ParallelState) -> nn.Module:
        groups = parallel_state.ranks_along("cp") if plan.nested else None
        apply_cp_plan(model, plan, parallel_state.mesh("cp"), groups)
        return model
