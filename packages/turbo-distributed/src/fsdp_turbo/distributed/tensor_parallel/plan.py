"""Turn the TP plan's patterns into one parallel style per module. Pure: raises
ConfigError, never communicates, so it runs on every rank before any collective."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_inspect import attention_heads, output_head, repeated_blocks
from fsdp_turbo.core.patterns import check_disjoint, match_modules
from fsdp_turbo.distributed.tensor_parallel.styles import (
    SEQUENCE_DIM,
    HeadLocalParallel,
    PrepareHiddenStates,
    ReplicateParallel,
    ScatterSequence,
)
from fsdp_turbo.fsdp_turbo_config import TPPlanConfig

SHARDABLE = (nn.Linear, nn.Embedding)


@dataclass
class ResolvedTPPlan:
    """Module name -> style, plus the parameter groups that must stay tied."""

    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    tied: list[list[tuple[str, str]]] = field(default_factory=list)
    loss_head: str | None = None

    def add(self, name: str, style: ParallelStyle, kind: str) -> None:
        self.styles[name], self.kinds[name] = style, kind


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _children_own_params(module: nn.Module) -> bool:
    return any(any(True for _ in child.parameters()) for child in module.children())


def _check_types_and_sizes(modules: dict[str, nn.Module], field_name: str, tp: int, colwise: bool) -> None:
    for name, module in modules.items():
        if not isinstance(module, SHARDABLE):
            raise ConfigError(field_name, name, "pick nn.Linear (or nn.Embedding) modules, e.g. '*.q_proj'",
                              reason=f"{name} is a {type(module).__name__}, which tensor parallel cannot shard")
        if isinstance(module, nn.Linear):
            size, what = (module.out_features, "out_features") if colwise else (module.in_features, "in_features")
        else:
            size, what = (module.embedding_dim, "embedding_dim") if colwise else (module.num_embeddings,
                                                                                 "num_embeddings")
        if size % tp:
            raise ConfigError(field_name, name, f"use a tensor_parallel_size that divides {what}={size}",
                              reason=f"{what}={size} does not split into {tp} equal shards")


def _check_heads(model: nn.Module, tp: int) -> None:
    _, kv_heads = attention_heads(model)
    if kv_heads is not None and kv_heads % tp:
        # Replicating K/V heads across TP ranks is not supported: keep the shards even.
        raise ConfigError("tensor_parallel_size", tp, f"use a tensor_parallel_size that divides "
                          f"num_key_value_heads={kv_heads}", reason="key/value heads must split evenly")


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    owners: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            if (module_name, param_name) not in owners[id(param)]:
                owners[id(param)].append((module_name, param_name))
    return [group for group in owners.values() if len(group) > 1]


def _outside(exclude: Collection[str]) -> Callable[[str, nn.Module], bool]:
    prefixes = tuple(name + "." for name in exclude)
    return lambda name, _module: name not in exclude and not name.startswith(prefixes)


def resolve_tp_plan(model: nn.Module, plan: TPPlanConfig, tp: int, exclude: Collection[str] = ()) -> ResolvedTPPlan:
    """Validate ``plan`` on ``model`` and choose a style for every module TP touches.

    Modules in ``exclude`` (expert-parallel containers) and everything inside them are
    left to their own transform: patterns do not see them and no style is chosen."""
    keep = _outside(frozenset(exclude))

    def pick(patterns, field_name, outermost=False):
        return match_modules(model, patterns, field=field_name, outermost=outermost, module_filter=keep) \
            if patterns else {}

    colwise = pick(plan.colwise_parallel, "tp_plan.colwise_parallel")
    rowwise = pick(plan.rowwise_parallel, "tp_plan.rowwise_parallel")
    sequence = pick(plan.sequence_parallel, "tp_plan.sequence_parallel", outermost=True)
    check_disjoint({"tp_plan.colwise_parallel": colwise, "tp_plan.rowwise_parallel": rowwise,
                    "tp_plan.sequence_parallel": sequence})
    _check_types_and_sizes(colwise, "tp_plan.colwise_parallel", tp, colwise=True)
    _check_types_and_sizes(rowwise, "tp_plan.rowwise_parallel", tp, colwise=False)
    _check_heads(model, tp)
    sp = bool(sequence)
    resolved = ResolvedTPPlan()
    blocks = repeated_blocks(model)
    block_names = set(blocks)
    planned = set(colwise) | set(rowwise) | set(sequence)

    # A colwise projection inside a block's sub-module (attention, MLP) shares its input
    # with its siblings: prepare that input once at the parent.
    hook_parents = {_parent(n) for n, m in colwise.items() if isinstance(m, nn.Linear)}
    hook_parents = {p for p in hook_parents if p and p not in block_names and p not in planned}
    head_local = {
        name: module for name, module in model.named_modules()
        if name and keep(name, module) and name not in planned and _parent(name) in hook_parents
        and _own_params(module) and not _children_own_params(module)
    }

    resolved.loss_head = _loss_head(model, plan, colwise)
    head_name = _output_head(model)
    for name in hook_parents:
        resolved.add(name, PrepareHiddenStates(sequence_parallel=sp), "prepare_input")
    for name, module in colwise.items():
        style = _colwise_style(module, own_input=_parent(name) not in hook_parents, sp=sp,
                               loss_parallel=name == resolved.loss_head, output_head=name == head_name)
        resolved.add(name, style, "colwise")
    for name, module in rowwise.items():
        if isinstance(module, nn.Embedding):
            style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            style = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM) if sp else Replicate())
        resolved.add(name, style, "rowwise")
    for name in sequence:
        resolved.add(name, SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True), "sequence_parallel")
    for name in head_local:
        resolved.add(name, HeadLocalParallel(), "head_local")
    if sp:
        _check_sequence_region(model, plan, blocks, set(resolved.styles))
        first = next(iter(blocks))
        resolved.add(first, ScatterSequence(), "scatter_sequence")
        head = _output_head(model)
        if head is None:
            raise ConfigError("tp_plan.sequence_parallel", list(plan.sequence_parallel),
                              "sequence parallel needs an output head (get_output_embeddings()) to gather before")
        if head not in colwise:
            resolved.add(head, ReplicateParallel(gather_sequence=True), "gather_replicate")
    # Inside the sequence region, a leftover module not behind a prepared (gathered) input
    # sees only this rank's tokens: an MoE router or its experts.
    sequence_local = (lambda name: any(name.startswith(b + ".") for b in block_names)
                      and not any(name.startswith(p + ".") for p in hook_parents)) if sp else (lambda name: False)
    _replicate_the_rest(model, resolved, colwise, rowwise, sequence_local, keep)
    resolved.tied = _check_tied(model, resolved)
    return resolved


def _colwise_style(module: nn.Module, *, own_input: bool, sp: bool, loss_parallel: bool,
                   output_head: bool) -> ParallelStyle:
    if isinstance(module, nn.Embedding):
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    input_layout = Shard(SEQUENCE_DIM) if (sp and own_input) else Replicate()
    if loss_parallel:
        return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)
    if output_head:
        # The model's loss and its users read whole-vocabulary logits: gather them.
        return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())
    return ColwiseParallel(input_layouts=input_layout)


def _loss_head(model: nn.Module, plan: TPPlanConfig, colwise: dict[str, nn.Module]) -> str | None:
    if not plan.loss_parallel:
        return None
    head = _output_head(model)
    if head is None or head not in colwise:
        raise ConfigError("tp_plan.loss_parallel", True,
                          f"add the output head ({head or 'e.g. lm_head'!r}) to tp_plan.colwise_parallel",
                          reason="loss parallel needs the output head sharded on the vocabulary")
    return head


def _output_head(model: nn.Module) -> str | None:
    found = output_head(model)
    return found[0] if found else None


def _check_sequence_region(model: nn.Module, plan: TPPlanConfig, blocks: dict, styled: set[str]) -> None:
    if not blocks:
        raise ConfigError("tp_plan.sequence_parallel", list(plan.sequence_parallel),
                          "sequence parallel needs a model with a repeated block list (e.g. decoder layers)")
    missing = [name for name, module in model.named_modules()
               if name and "norm" in type(module).__name__.lower() and name not in styled]
    if missing:
        raise ConfigError("tp_plan.sequence_parallel", list(plan.sequence_parallel),
                          f"add every norm on the sequence-sharded path, e.g. {missing[:4]}",
                          reason=f"{len(missing)} norm module(s) would see sequence shards as if replicated")


def _replicate_the_rest(model: nn.Module, resolved: ResolvedTPPlan, colwise: dict, rowwise: dict,
                        sequence_local: Callable[[str], bool], keep: Callable[[str, nn.Module], bool]) -> None:
    sharded = set(colwise) | set(rowwise)
    for name, module in model.named_modules():
        if not name or not keep(name, module) or name in resolved.styles or name in sharded or not _own_params(module):
            continue
        if _children_own_params(module):
            raise ConfigError("tp_plan", name, "give its parameters their own leaf module, or shard it",
                              reason=f"{name} owns parameters and has sub-modules; TP cannot place them")
        if sequence_local(name):
            resolved.add(name, ReplicateParallel(sum_grads=True), "replicate_sequence_local")
        else:
            resolved.add(name, ReplicateParallel(), "replicate")


def _check_tied(model: nn.Module, resolved: ResolvedTPPlan) -> list[list[tuple[str, str]]]:
    groups = _tied_groups(model)
    for group in groups:
        kinds = {resolved.kinds.get(module_name) for module_name, _ in group}
        replicated = kinds <= {"replicate", "gather_replicate"}
        if (replicated or kinds == {"rowwise", "colwise"}) and _vocab_shards_agree(model, group, resolved):
            continue
        names = [m for m, _ in group]
        raise ConfigError("tp_plan", names, "shard tied weights alike: the embedding rowwise and the output head "
                          "colwise, or neither", reason="these modules share one parameter")
    return groups


def _vocab_shards_agree(model: nn.Module, group: list[tuple[str, str]], resolved: ResolvedTPPlan) -> bool:
    # Embedding rowwise and Linear colwise both shard the [vocab, hidden] weight on dim 0.
    for module_name, _ in group:
        kind = resolved.kinds.get(module_name)
        module = model.get_submodule(module_name)
        if kind == "rowwise" and not isinstance(module, nn.Embedding):
            return False
        if kind == "colwise" and not isinstance(module, nn.Linear):
            return False
    return True
