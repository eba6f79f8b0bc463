"""Turn the TP plan's patterns into one parallel style per module. Pure: raises
ConfigError, never communicates, so it runs on every rank before any collective."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.families.resolve import LatentFact
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.model_inspect import is_tuner_layer, tied_parameter_groups
from fsdp_turbo.core.patterns import check_disjoint, match_modules
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow
from fsdp_turbo.core.stage_part import HeldElsewhere
from fsdp_turbo.distributed.tensor_parallel.lora import (
    adapter_names,
    check_lora_layer,
    is_lora_linear,
    lora_sharded_linears,
)
from fsdp_turbo.distributed.tensor_parallel.styles import (
    SEQUENCE_DIM,
    CutTokenInputs,
    FrozenKeepingSequenceParallel,
    HeadLocalParallel,
    HeadsNormParallel,
    PrepareHiddenStates,
    ReplicateParallel,
    ScatterSequence,
    WholeModuleParallel,
)
from fsdp_turbo.fsdp_turbo_config import TPPlanConfig

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

SHARDABLE = (nn.Linear, nn.Embedding)


class StyleKind(StrEnum):
    """What tensor parallel does to one module (see ``styles.py`` for the ones torch lacks)."""

    COLWISE = "colwise"  # weight split on its output dim (Embedding: on embedding_dim)
    ROWWISE = "rowwise"  # weight split on its input dim (Embedding: on num_embeddings)
    SEQUENCE_PARALLEL = "sequence_parallel"  # a norm computing on this rank's sequence slice
    PREPARE_INPUT = "prepare_input"  # the parent of colwise siblings: its input gathered once
    HEAD_LOCAL = "head_local"  # acts per head on head-sharded activations (Qwen3's q_norm)
    HEADS_NORM = "heads_norm"  # an RMS norm over every head's channels (MiniMax-M2's q_norm): its statistic summed
    SCATTER_SEQUENCE = "scatter_sequence"  # the first block: the entry into the sequence region
    CUT_TOKEN_INPUTS = "cut_token_inputs"  # the other blocks: their per-token inputs cut (Gemma 4's per_layer_input)
    GATHER_REPLICATE = "gather_replicate"  # an unsharded output head after sequence parallel
    REPLICATE = "replicate"  # outside the plan: replicated parameters, local compute
    REPLICATE_SEQUENCE_LOCAL = "replicate_sequence_local"  # ditto, seeing this rank's tokens only
    REPLICATE_PREPARED = "replicate_prepared"  # ditto, on a prepared (replicated) input: a colwise LoRA's lora_A
    WHOLE = "whole"  # a module with parameters beside sub-modules, none planned: its subtree replicated
    WHOLE_GATHERED = "whole_gathered"  # ditto in the sequence region: on the gathered sequence (Gated DeltaNet)


SHARDED_KINDS = frozenset({StyleKind.COLWISE, StyleKind.ROWWISE})


@dataclass(frozen=True)
class StyleChoice:
    """A style, as data; ``build_style`` makes the torch ``ParallelStyle`` from it."""

    kind: StyleKind
    embedding: bool = False  # the module is an nn.Embedding
    sequence_sharded: bool = False  # colwise: input on sequence shards; rowwise: output; prepare_input: SP
    vocab_shards: bool = False  # colwise head under loss parallel: keep the logits vocab-sharded
    gather_output: bool = False  # colwise output head without loss parallel: whole-vocabulary logits
    head_parameters: tuple[tuple[str, int], ...] = ()  # prepare_input: own per-head parameters -> their head dim
    shared_tail: int = 0  # replicate_prepared: the last outputs every head reads, their gradient summed over TP
    token_inputs: tuple[str, ...] = ()  # scatter_sequence / cut_token_inputs: block arguments cut to the rank's tokens


def build_style(choice: StyleChoice) -> ParallelStyle:
    kind, sequence = choice.kind, Shard(SEQUENCE_DIM)
    if kind is StyleKind.COLWISE:
        if choice.embedding:
            return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        input_layout = sequence if choice.sequence_sharded else Replicate()
        if choice.vocab_shards:
            return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)
        if choice.gather_output:
            return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())
        return ColwiseParallel(input_layouts=input_layout)
    if kind is StyleKind.ROWWISE:
        if choice.embedding:
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        return RowwiseParallel(output_layouts=sequence if choice.sequence_sharded else Replicate())
    builders = {
        StyleKind.SEQUENCE_PARALLEL: lambda: FrozenKeepingSequenceParallel(sequence_dim=SEQUENCE_DIM,
                                                                           use_local_output=True),
        StyleKind.PREPARE_INPUT: lambda: PrepareHiddenStates(sequence_parallel=choice.sequence_sharded,
                                                             head_parameters=choice.head_parameters),
        StyleKind.HEAD_LOCAL: HeadLocalParallel,
        StyleKind.HEADS_NORM: HeadsNormParallel,
        StyleKind.SCATTER_SEQUENCE: lambda: ScatterSequence(choice.token_inputs),
        StyleKind.CUT_TOKEN_INPUTS: lambda: CutTokenInputs(choice.token_inputs),
        StyleKind.GATHER_REPLICATE: lambda: ReplicateParallel(gather_sequence=True),
        StyleKind.REPLICATE: ReplicateParallel,
        StyleKind.REPLICATE_SEQUENCE_LOCAL: lambda: ReplicateParallel(sum_grads=True),
        StyleKind.REPLICATE_PREPARED: lambda: ReplicateParallel(local_input=True, shared_tail=choice.shared_tail),
        StyleKind.WHOLE: WholeModuleParallel,
        StyleKind.WHOLE_GATHERED: lambda: WholeModuleParallel(sequence_parallel=True),
    }
    return builders[kind]()


TiedGroup = tuple[tuple[str, str], ...]  # (module name, parameter name) sharing one parameter


@dataclass(frozen=True)
class TPPlan(FeaturePlan):
    """Module name -> style, in the order to apply them, plus what TP splits and ties."""

    tp: int
    styles: tuple[tuple[str, StyleChoice], ...]
    tied: tuple[TiedGroup, ...] = ()
    loss_head: str | None = None
    shard_dims: tuple[tuple[str, int], ...] = ()  # parameter name -> the dim TP splits
    kind_rows: tuple[PlanRow, ...] = ()  # what TP does with each attention kind (fsdp-turbo plan)

    @property
    def kinds(self) -> dict[str, StyleKind]:
        return {name: choice.kind for name, choice in self.styles}

    def local_shape(self, parameter: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` of ``parameter`` as one TP rank holds it."""
        dim = dict(self.shard_dims).get(parameter)
        if dim is None:
            return tuple(shape)
        return tuple(size // self.tp if index == dim else size for index, size in enumerate(shape))

    def describe(self) -> tuple[PlanRow, ...]:
        by_kind: dict[str, list[str]] = defaultdict(list)
        for name, choice in self.styles:
            by_kind[choice.kind.value].append(name)
        rows = [PlanRow(f"tp_plan ({kind})", tuple(names)) for kind, names in sorted(by_kind.items())]
        return (*rows, *self.kind_rows)

    def estimate(self, memory: MemoryModel) -> None:
        for parameter, dim in self.shard_dims:
            if parameter in memory.params:  # a tied parameter is listed once, under its first name
                memory.params[parameter].shape[dim] //= self.tp
        if self.loss_head is not None:
            memory.vocab_shards = self.tp
        memory.layer.tp = self.tp
        memory.layer.sequence_parallel = any(kind is StyleKind.SEQUENCE_PARALLEL for kind in self.kinds.values())


def _shard_dims(name: str, module: nn.Module, kind: StyleKind) -> list[tuple[str, int]]:
    # Linear weights are [out, in]: colwise splits dim 0 (and the bias), rowwise dim 1.
    # Embedding weights are [num_embeddings, embedding_dim]: colwise splits dim 1, rowwise dim 0.
    colwise = kind is StyleKind.COLWISE
    if isinstance(module, nn.Embedding):
        return [(f"{name}.weight", 1 if colwise else 0)]
    dims = [(f"{name}.weight", 0 if colwise else 1)]
    if colwise and module.bias is not None:
        dims.append((f"{name}.bias", 0))
    return dims


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _ancestors(name: str) -> list[str]:
    """The names of the modules holding ``name``, innermost first (the root excluded)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _children_own_params(module: nn.Module) -> bool:
    return any(any(True for _ in child.parameters()) for child in module.children())


def _sharded_layers(name: str, module: nn.Module, field_name: str, colwise: bool) -> list[tuple[str, nn.Module]]:
    """The layers TP splits for a picked module: itself, or a LoRA layer's base and sharded factors."""
    if is_tuner_layer(module):
        check_lora_layer(field_name, name, module)
        return lora_sharded_linears(name, module, colwise)
    if not isinstance(module, SHARDABLE):
        raise ConfigError(field_name, name, "pick nn.Linear (or nn.Embedding) modules, e.g. '*.q_proj'",
                          reason=f"{name} is a {type(module).__name__}, which tensor parallel cannot shard")
    return [(name, module)]


def _check_types_and_sizes(modules: dict[str, nn.Module], field_name: str, tp: int, colwise: bool) -> None:
    for picked, module in modules.items():
        for name, layer in _sharded_layers(picked, module, field_name, colwise):
            if isinstance(layer, nn.Linear):
                size, what = (layer.out_features, "out_features") if colwise else (layer.in_features, "in_features")
            else:
                size, what = (layer.embedding_dim, "embedding_dim") if colwise else (layer.num_embeddings,
                                                                                   "num_embeddings")
            if size % tp:
                raise ConfigError(field_name, name, f"use a tensor_parallel_size that divides {what}={size}",
                                  reason=f"{what}={size} does not split into {tp} equal shards")


def _check_heads(facts: ModelFacts, tp: int) -> None:
    heads, kv_heads = facts.num_attention_heads, facts.num_key_value_heads
    if heads is not None and heads % tp:
        raise ConfigError("tensor_parallel_size", tp, f"use a tensor_parallel_size that divides "
                          f"num_attention_heads={heads}", reason=f"the model has {heads} attention heads "
                          f"({kv_heads} key/value heads)")
    if kv_heads is not None and kv_heads % tp:
        # Replicating K/V heads across TP ranks is not supported: keep the shards even.
        raise ConfigError("tensor_parallel_size", tp, f"use a tensor_parallel_size that divides "
                          f"num_key_value_heads={kv_heads}, or leave the attention out of tp_plan (an attention "
                          "the plan does not split is kept whole)", reason="key/value heads must split evenly")


def _outside(exclude: Collection[str]) -> Callable[[str, nn.Module], bool]:
    prefixes = tuple(name + "." for name in exclude)
    return lambda name, _module: name not in exclude and not name.startswith(prefixes)


@dataclass(frozen=True)
class _Matches:
    """What the plan's patterns picked, each in model order."""

    colwise: dict[str, nn.Module]
    rowwise: dict[str, nn.Module]
    sequence: dict[str, nn.Module]


def _match(model: nn.Module, plan: TPPlanConfig, keep: Callable[[str, nn.Module], bool],
           linear: dict[str, str]) -> _Matches:
    """The plan's picks among the modules ``keep`` admits; a pattern whose every match lies
    inside a linear-attention layer (``linear``: name -> form, kept whole) is refused by name."""
    def pick(patterns, field_name, outermost=False):
        if not patterns:
            return {}
        for pattern in patterns:
            hits = match_modules(model, [pattern], field=field_name, module_filter=lambda n, m: keep(n, m)
                                 or any(_inside(n, [layer]) for layer in linear))
            if hits and all(not keep(name, module) for name, module in hits.items()):
                layer = next(layer for layer in linear if _inside(next(iter(hits)), [layer]))
                raise ConfigError(field_name, pattern, f"leave {layer}'s sub-modules out of tp_plan (TP keeps it "
                                  "whole)", reason=f"the pattern picks only modules inside {layer}, a "
                                                   f"linear-attention layer ({linear[layer]}), which TP cannot split")
        return match_modules(model, patterns, field=field_name, outermost=outermost, module_filter=keep)

    return _Matches(colwise=pick(plan.colwise_parallel, "tp_plan.colwise_parallel"),
                    rowwise=pick(plan.rowwise_parallel, "tp_plan.rowwise_parallel"),
                    sequence=pick(plan.sequence_parallel, "tp_plan.sequence_parallel", outermost=True))


def _check_lora_kept_whole(model: nn.Module, picked: dict[str, nn.Module], field_name: str) -> None:
    # A LoRA layer's base_layer (or factor) sharded alone would leave the adapter's term
    # whole beside a sharded base output.
    for name in picked:
        owner = next((held for held in _ancestors(name) if is_lora_linear(model.get_submodule(held))), None)
        if owner is not None:
            raise ConfigError(field_name, name, f"pick the LoRA layer {owner} itself (e.g. '*.q_proj', not "
                              "'*.q_proj.base_layer'): tensor parallel splits its base and adapters together",
                              reason=f"{name} is inside the LoRA layer {owner}")


def _validate(model: nn.Module, matches: _Matches, tp: int, facts: ModelFacts) -> None:
    check_disjoint({"tp_plan.colwise_parallel": matches.colwise, "tp_plan.rowwise_parallel": matches.rowwise,
                    "tp_plan.sequence_parallel": matches.sequence})
    _check_lora_kept_whole(model, matches.colwise, "tp_plan.colwise_parallel")
    _check_lora_kept_whole(model, matches.rowwise, "tp_plan.rowwise_parallel")
    _check_types_and_sizes(matches.colwise, "tp_plan.colwise_parallel", tp, colwise=True)
    _check_types_and_sizes(matches.rowwise, "tp_plan.rowwise_parallel", tp, colwise=False)
    # the heads split only where the plan splits an attention (the facts' layers; any Linear when
    # the facts know none)
    attention = [layer.name for layer in facts.attention_layers]
    if not attention or any(_inside(name, attention) for name in matches.colwise):
        _check_heads(facts, tp)


def resolve_tp_plan(model: nn.Module, plan: TPPlanConfig, tp: int, facts: ModelFacts,
                    exclude: Collection[str] = ()) -> TPPlan:
    """Validate ``plan`` on ``model`` and choose a style for every module TP touches.

    Modules in ``exclude`` (expert-parallel containers) and everything inside them are
    left to their own transform: patterns do not see them and no style is chosen. The
    model facts' linear-attention layers are kept whole, and patterns do not see inside them
    either (a recurrent mixer's projections share names with attention's, as Kimi's do)."""
    outside_experts = _outside(frozenset(exclude))
    linear = {layer.name: layer.form.form if layer.form else "no registered form"
              for layer in facts.layers_of("linear") if outside_experts(layer.name, None)}
    keep = _outside(frozenset(exclude) | set(linear))
    matches = _match(model, plan, keep, linear)
    _validate(model, matches, tp, facts)
    loss_head = _loss_head(plan, matches.colwise, facts, model)
    styles = _choose_styles(model, plan, matches, loss_head, keep, facts, tp, tuple(linear))
    tied = _check_tied(model, styles)
    shard_dims = [dim for name, choice in styles.items() if choice.kind in SHARDED_KINDS
                  for dim in _shard_dims(name, model.get_submodule(name), choice.kind)]
    shard_dims += [(f"{name}.{parameter}", dim) for name, choice in styles.items()
                   for parameter, dim in choice.head_parameters]
    shard_dims += [(f"{name}.{parameter}", 0) for name, choice in styles.items() if choice.kind is StyleKind.HEADS_NORM
                   for parameter, _ in model.get_submodule(name).named_parameters(recurse=False)]
    return TPPlan(tp, tuple(styles.items()), tuple(tied), loss_head, tuple(shard_dims), _kind_rows(styles, facts))


def _kind_rows(styles: dict[str, StyleChoice], facts: ModelFacts) -> tuple[PlanRow, ...]:
    """What TP does with each attention kind of the model facts: the attentions it splits by
    head, the ones it keeps whole, and the per-head parameters it splits with the heads."""
    rows = []
    for kind in dict.fromkeys(layer.kind for layer in facts.attention_layers):
        names = [layer.name for layer in facts.layers_of(kind)]
        split = tuple(n for n in names if styles.get(n, StyleChoice(StyleKind.REPLICATE)).kind
                      is StyleKind.PREPARE_INPUT)
        whole = tuple(n for n in names if styles.get(n, StyleChoice(StyleKind.REPLICATE)).kind
                      in (StyleKind.WHOLE, StyleKind.WHOLE_GATHERED))
        if split:
            rows.append(PlanRow("tp_plan (split by head)", split, kind=kind))
        if whole:
            rows.append(PlanRow("tp_plan (kept whole, replicated)", whole, kind=kind))
    per_head = tuple(f"{name}.{parameter}" for name, choice in styles.items()
                     for parameter, _ in choice.head_parameters)
    if per_head:
        rows.append(PlanRow("tp_plan (split with the heads)", per_head, kind="per-head parameters"))
    return tuple(rows)


def _choose_styles(model: nn.Module, plan: TPPlanConfig, matches: _Matches, loss_head: str | None,
                   keep: Callable[[str, nn.Module], bool], facts: ModelFacts, tp: int,
                   linear: tuple[str, ...]) -> dict[str, StyleChoice]:
    colwise, rowwise, sequence = matches.colwise, matches.rowwise, matches.sequence
    sp = bool(sequence)
    blocks = {name: model.get_submodule(name) for name in facts.blocks}
    block_names = set(blocks)
    planned = set(colwise) | set(rowwise) | set(sequence)

    hook_parents = _hook_parents(model, colwise, block_names, planned)
    beside_the_heads = _beside_the_heads(model, keep, facts, colwise, planned, hook_parents)  # refuses first
    styles = {**_split_styles(model, matches, hook_parents, loss_head, facts, tp), **beside_the_heads}
    # A split sparse attention's indexer is whole on every rank, reading the prepared input (it
    # picks keys for every head; its forward computes no gradient)
    for name in facts.indexers:
        if keep(name, model.get_submodule(name)) and _inside(name, hook_parents):
            styles[name] = StyleChoice(StyleKind.REPLICATE_PREPARED)
    _refuse_splits_beside_own_parameters(model, styles, set(colwise) | set(rowwise), keep)
    whole = [*linear, *_unsplit_attention(model, facts, styles, set(colwise) | set(rowwise), keep, linear)]
    if sp:
        styles.update(_sequence_region_styles(model, plan, blocks, styles, whole, facts, colwise))

    # Inside the sequence region, a leftover module not behind a prepared (gathered) input
    # sees only this rank's tokens: an MoE router or its experts.
    # So does a module the facts say runs after the blocks (beside the final norm).
    after = set(facts.after_blocks)

    def sequence_local(name: str) -> bool:
        return sp and ((_inside(name, block_names) and not _inside(name, hook_parents))
                       or name in after or _inside(name, after))

    for name in whole:
        styles[name] = StyleChoice(StyleKind.WHOLE_GATHERED if sequence_local(name) else StyleKind.WHOLE)
    _replicate_the_rest(model, styles, set(colwise) | set(rowwise), sequence_local, keep, whole)
    return styles


def _split_styles(model: nn.Module, matches: _Matches, hook_parents: list[str], loss_head: str | None,
                  facts: ModelFacts, tp: int) -> dict[str, StyleChoice]:
    """The styles of what the plan names: the prepared inputs of split attentions (with their
    per-head parameters), colwise and rowwise projections, and the sequence-parallel modules."""
    sp = bool(matches.sequence)
    styles: dict[str, StyleChoice] = {}
    for name in hook_parents:
        styles[name] = StyleChoice(StyleKind.PREPARE_INPUT, sequence_sharded=sp,
                                   head_parameters=_head_parameters(name, model.get_submodule(name), tp, facts))
    for name, module in matches.colwise.items():
        prepared = _parent(name) in hook_parents
        choice = _colwise_choice(module, sequence_input=sp and not prepared,
                                 vocab_shards=name == loss_head, gather_output=name == facts.head)
        styles.update(_lora_colwise_styles(name, module, choice, prepared) if is_lora_linear(module)
                      else {name: choice})
    for name, module in matches.rowwise.items():
        embedding = isinstance(module, nn.Embedding)
        choice = StyleChoice(StyleKind.ROWWISE, embedding=embedding, sequence_sharded=sp and not embedding)
        styles.update(_lora_rowwise_styles(name, module, choice) if is_lora_linear(module) else {name: choice})
    for name in matches.sequence:
        styles[name] = StyleChoice(StyleKind.SEQUENCE_PARALLEL)
    return styles


def _beside_the_heads(model: nn.Module, keep: Callable[[str, nn.Module], bool], facts: ModelFacts,
                      colwise: dict[str, nn.Module], planned: set[str],
                      hook_parents: list[str]) -> dict[str, StyleChoice]:
    """The unplanned leaves of a split attention, beside its heads: latents every head reads
    (whole), norms over every head's channels (split with the heads), and the rest (local to
    this rank's heads; a projection among them is refused)."""
    head_local = [name for name, module in model.named_modules()
                  if name and keep(name, module) and name not in planned and _parent(name) in hook_parents
                  and _own_params(module) and not _children_own_params(module)]
    latent = {name: known for name in head_local if (known := facts.latent(name)) is not None}
    heads_norms = _heads_norms(facts, head_local, colwise)
    head_local = [name for name in head_local if name not in latent and name not in heads_norms]
    _refuse_unplanned_projections(model, head_local)
    styles = {name: StyleChoice(StyleKind.HEAD_LOCAL) for name in head_local}
    styles.update({name: StyleChoice(StyleKind.HEADS_NORM) for name in heads_norms})
    styles.update({name: _latent_choice(model, name, known) for name, known in latent.items()})
    return styles


def _unsplit_attention(model: nn.Module, facts: ModelFacts, styles: dict[str, StyleChoice], sharded: set[str],
                       keep: Callable[[str, nn.Module], bool], linear: tuple[str, ...]) -> list[str]:
    """The facts' attention layers the plan leaves unsplit (nothing inside them planned): each is
    kept whole, so under sequence parallel it computes on the gathered sequence, as attention
    must (DeepSeek-V4's, whose one key/value head and compressed entries every head reads)."""
    touched = set(styles) | sharded
    return [layer.name for layer in facts.attention_layers
            if layer.name not in linear and keep(layer.name, model.get_submodule(layer.name))
            and layer.name not in touched and not any(_inside(name, [layer.name]) for name in touched)]


def _hook_parents(model: nn.Module, colwise: dict[str, nn.Module], block_names: set[str],
                  planned: set[str]) -> list[str]:
    """A colwise projection inside a block's sub-module (attention, MLP) shares its input
    with its siblings: that input is prepared once at the parent. In model order, so every
    rank makes the same plan. A parent holding the blocks is the model itself (the output
    head's parent under a wrapper's prefix, e.g. PEFT's base_model.model): its input is not
    the hidden states."""
    parents = {_parent(n) for n, m in colwise.items() if isinstance(m, nn.Linear) or is_lora_linear(m)}
    holds_blocks = {ancestor for name in block_names for ancestor in _ancestors(name)}
    return [n for n, _ in model.named_modules()
            if n and n in parents and n not in block_names and n not in planned and n not in holds_blocks]


def _sequence_region_styles(model: nn.Module, plan: TPPlanConfig, blocks: dict, styles: dict[str, StyleChoice],
                            whole: list[str], facts: ModelFacts,
                            colwise: dict[str, nn.Module]) -> dict[str, StyleChoice]:
    """Sequence parallel's entry (the first block cuts the sequence) and exit (an output head
    left whole gathers it), once every norm on the sequence-sharded path is known to be planned."""
    _check_sequence_region(model, plan, blocks, set(styles), whole, facts.before_blocks)
    head_name = facts.head
    if head_name is None:
        raise ConfigError("tp_plan.sequence_parallel", list(plan.sequence_parallel),
                          "name the output head in model_facts.head_module (sequence parallel gathers before it)",
                          reason="the model has no get_output_embeddings() to find it by")
    first, *rest = blocks
    inputs = facts.block_token_inputs
    added = {first: StyleChoice(StyleKind.SCATTER_SEQUENCE, token_inputs=inputs)}
    added.update({name: StyleChoice(StyleKind.CUT_TOKEN_INPUTS, token_inputs=inputs) for name in rest if inputs})
    if head_name not in colwise:
        added[head_name] = StyleChoice(StyleKind.GATHER_REPLICATE)
    return added


def _head_counts(module: nn.Module, facts: ModelFacts) -> set[int]:
    counts = {facts.num_attention_heads, facts.num_key_value_heads}
    counts |= {getattr(module, attribute, None) for attribute in ("num_heads", "num_attention_heads",
                                                                  "num_key_value_heads")}
    return {count for count in counts if isinstance(count, int)}


def _latent_choice(model: nn.Module, name: str, known: LatentFact) -> StyleChoice:
    """A latent Linear reads the prepared (replicated) input; a latent norm the Linear's local output."""
    if not isinstance(model.get_submodule(name), nn.Linear):
        return StyleChoice(StyleKind.REPLICATE)
    return StyleChoice(StyleKind.REPLICATE_PREPARED, shared_tail=known.shared_tail)


def _heads_norms(facts: ModelFacts, head_local: list[str], colwise: dict[str, nn.Module]) -> list[str]:
    """The model facts' norms over every head's channels among the modules beside the split
    projections. Each normalises a projection's output, which must then be split too (by head,
    colwise): the norm's weight splits with it and its statistic is summed over the ranks."""
    found = []
    for fact in facts.heads_norms:
        if fact.module not in head_local:
            continue
        if fact.projection not in colwise:
            raise ConfigError("tp_plan.colwise_parallel", fact.projection, f"add {fact.projection!r} to "
                              "tp_plan.colwise_parallel (split it by head beside the other projections)",
                              reason=f"{fact.module} normalises its output over every head at once, and a norm "
                                     "beside split projections sees one rank's heads")
        found.append(fact.module)
    return found


def _refuse_unplanned_projections(model: nn.Module, head_local: list[str]) -> None:
    """Beside the split projections of an attention, the modules no plan names run per head on
    this rank's heads (Qwen3's ``q_norm``). A Linear there is not per head: it reads every head
    (an output projection left whole), or it reads the attention's input and what it computes
    reaches every head by another path than a split projection (a ``k_proj`` left whole beside
    a split ``q_proj``), so its gradient would hold one rank's heads only. Refused by name
    rather than trained wrong, unless the model facts name it a latent (MLA's)."""
    for name in head_local:
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            attention = _parent(name)
            raise ConfigError("tp_plan.colwise_parallel", attention,
                              f"leave {attention}'s projections out of tp_plan (split the MLP or the experts only), "
                              f"or, if every head reads its output, declare it in model_facts.latent_modules "
                              f"(e.g. '{name}')",
                              reason=f"{name} is a Linear of {type(model.get_submodule(attention)).__name__} "
                                     "that the TP plan leaves whole beside split projections: it is not per head "
                                     "(it reads or feeds every head), so its gradient would hold one rank's heads")


def _head_parameters(name: str, module: nn.Module, tp: int, facts: ModelFacts) -> tuple[tuple[str, int], ...]:
    """The parameters ``module`` (whose colwise projections TP splits) holds itself, each with
    the dim TP splits it on (the model facts' per-head parameters). A parameter the facts do
    not name would be read whole beside this rank's heads (a shape error in the forward, or a
    gradient from one rank's heads only): refused here, by name."""
    known = {fact.parameter: fact for fact in facts.head_parameters_of(name)}
    split = []
    for parameter, value in module.named_parameters(recurse=False):
        full = f"{name}.{parameter}"
        fact = known.get(parameter)
        if fact is None:
            per_head = value.dim() >= 1 and value.shape[0] in _head_counts(module, facts)
            kind = (f"a per-head parameter (leading dim {value.shape[0]}: the head count)" if per_head
                    else "a parameter it holds itself")
            raise ConfigError("tp_plan.colwise_parallel", full,
                              f"leave {name}'s projections out of tp_plan, or declare {parameter} a per-head "
                              f"parameter in model_facts.head_parameters (e.g. '{full}')",
                              reason=f"{full} {list(value.shape)} is {kind}, which the model facts do not say "
                                     f"how to split beside the sharded projections of {type(module).__name__}")
        size = value.shape[fact.dim]
        if size % tp:
            raise ConfigError("tensor_parallel_size", tp, f"use a tensor_parallel_size that divides {size}",
                              reason=f"{full} ({fact.what}) has {size} heads on dim {fact.dim}")
        split.append((parameter, fact.dim))
    return tuple(split)


def _colwise_choice(module: nn.Module, *, sequence_input: bool, vocab_shards: bool,
                    gather_output: bool) -> StyleChoice:
    if isinstance(module, nn.Embedding):
        return StyleChoice(StyleKind.COLWISE, embedding=True)
    # Loss parallel keeps the head's logits vocab-sharded; without it the model's loss and
    # its users read whole-vocabulary logits, so the output head gathers them.
    return StyleChoice(StyleKind.COLWISE, sequence_sharded=sequence_input, vocab_shards=vocab_shards,
                       gather_output=gather_output and not vocab_shards)


def _lora_colwise_styles(name: str, module: nn.Module, base: StyleChoice, prepared: bool) -> dict[str, StyleChoice]:
    # base_layer and lora_B read one replicated input and end output-sharded alike (the
    # head's flags included), so the layer's output is the sum of two output shards.
    # lora_A reads the same input whole. Without a parent that prepares the input, the
    # LoRA layer prepares it itself: gathered once, not by base_layer and lora_A each.
    styles = {} if prepared else {name: StyleChoice(StyleKind.PREPARE_INPUT, sequence_sharded=base.sequence_sharded)}
    sharded = replace(base, sequence_sharded=False)
    styles[f"{name}.base_layer"] = sharded
    for adapter in adapter_names(module):
        styles[f"{name}.lora_A.{adapter}"] = StyleChoice(StyleKind.REPLICATE_PREPARED)
        styles[f"{name}.lora_B.{adapter}"] = sharded
    return styles


def _lora_rowwise_styles(name: str, module: nn.Module, base: StyleChoice) -> dict[str, StyleChoice]:
    # lora_A splits the input as base_layer does and ends in the same layout: reduced, or
    # reduce-scattered to sequence shards. lora_B then computes on that: with sequence
    # parallel each rank holds other tokens, so its gradients are summed over TP.
    styles = {f"{name}.base_layer": base}
    local = StyleKind.REPLICATE_SEQUENCE_LOCAL if base.sequence_sharded else StyleKind.REPLICATE
    for adapter in adapter_names(module):
        styles[f"{name}.lora_A.{adapter}"] = base
        styles[f"{name}.lora_B.{adapter}"] = StyleChoice(local)
    return styles


def _loss_head(plan: TPPlanConfig, colwise: dict[str, nn.Module], facts: ModelFacts,
               model: nn.Module) -> str | None:
    head = facts.head
    if not plan.loss_parallel or (head is not None and isinstance(model.get_submodule(head), HeldElsewhere)):
        return None  # off, or a pipeline stage before the head's
    if head is None or head not in colwise:
        raise ConfigError("tp_plan.loss_parallel", True,
                          f"add the output head ({head or 'e.g. lm_head'!r}) to tp_plan.colwise_parallel",
                          reason="loss parallel needs the output head sharded on the vocabulary")
    return head


def _inside(name: str, holders: Collection[str]) -> bool:
    return any(name.startswith(holder + ".") for holder in holders)


def _refuse_splits_beside_own_parameters(model: nn.Module, styles: dict[str, StyleChoice], sharded: set[str],
                                         keep: Callable[[str, nn.Module], bool]) -> None:
    """A module left out of the plan that holds parameters itself beside sub-modules with
    parameters (a router's scale beside its projection) is replicated, each part on its own.
    If the plan splits or styles anything inside one, the module's own parameters would be read
    whole beside split children: refused, by name. (The model facts' linear-attention layers,
    which must also see the whole sequence, are kept whole: ``WholeModuleParallel``.)"""
    touched = set(styles) | sharded
    for name, module in model.named_modules():
        if (not name or not keep(name, module) or name in touched or not _own_params(module)
                or not _children_own_params(module)):
            continue
        inside = sorted(n for n in touched if n.startswith(name + "."))
        if inside:
            own = ", ".join(n for n, _ in module.named_parameters(recurse=False))
            raise ConfigError("tp_plan", inside[0], f"leave {name}'s sub-modules out of tp_plan (TP keeps it whole)",
                              reason=f"{name} owns parameters ({own}) beside its sub-modules, which TP cannot "
                                     "split with them")


def _check_sequence_region(model: nn.Module, plan: TPPlanConfig, blocks: dict, styled: set[str],
                           whole: Collection[str], before_blocks: Collection[str]) -> None:
    if not blocks:
        raise ConfigError("tp_plan.sequence_parallel", list(plan.sequence_parallel),
                          "sequence parallel needs a model with a repeated block list (e.g. decoder layers)")
    # Inside the blocks a norm left out of the plan computes on this rank's tokens with its
    # gradient summed over TP (replicate_sequence_local), as a sequence-parallel one would; a
    # module kept whole computes its norms on the gathered sequence; a norm without parameters
    # acts on each token alone. Outside the blocks, a norm after them (the final one) must be
    # planned, one the facts say runs before them sees the whole sequence.
    missing = [name for name, module in model.named_modules()
               if name and "norm" in type(module).__name__.lower() and name not in styled and name not in whole
               and not _inside(name, whole) and _own_params(module) and name not in before_blocks
               and not _inside(name, blocks)]
    if missing:
        raise ConfigError("tp_plan.sequence_parallel", list(plan.sequence_parallel),
                          f"add every norm on the sequence-sharded path, e.g. {missing[:4]}",
                          reason=f"{len(missing)} norm module(s) would see sequence shards as if replicated")


def _replicate_the_rest(model: nn.Module, styles: dict[str, StyleChoice], sharded: set[str],
                        sequence_local: Callable[[str], bool], keep: Callable[[str, nn.Module], bool],
                        whole: Collection[str]) -> None:
    for name, module in model.named_modules():
        if (not name or not keep(name, module) or name in styles or name in sharded or not _own_params(module)
                or _inside(name, whole)):
            continue
        kind = StyleKind.REPLICATE_SEQUENCE_LOCAL if sequence_local(name) else StyleKind.REPLICATE
        styles[name] = StyleChoice(kind)


def _check_tied(model: nn.Module, styles: dict[str, StyleChoice]) -> list[TiedGroup]:
    groups = tied_parameter_groups(model)
    kinds = {name: choice.kind for name, choice in styles.items()}
    for group in groups:
        group_kinds = {kinds.get(module_name) for module_name, _ in group}
        replicated = group_kinds <= {StyleKind.REPLICATE, StyleKind.GATHER_REPLICATE}
        if (replicated or group_kinds == set(SHARDED_KINDS)) and _vocab_shards_agree(model, group, kinds):
            continue
        names = [m for m, _ in group]
        raise ConfigError("tp_plan", names, "shard tied weights alike: the embedding rowwise and the output head "
                          "colwise, or neither", reason="these modules share one parameter")
    return groups


def _vocab_shards_agree(model: nn.Module, group: TiedGroup, kinds: dict[str, StyleKind]) -> bool:
    # Embedding rowwise and Linear colwise both shard the [vocab, hidden] weight on dim 0.
    for module_name, _ in group:
        kind = kinds.get(module_name)
        module = model.get_submodule(module_name)
        if kind is StyleKind.ROWWISE and not isinstance(module, nn.Embedding):
            return False
        if kind is StyleKind.COLWISE and not isinstance(module, nn.Linear):
            return False
    return True
