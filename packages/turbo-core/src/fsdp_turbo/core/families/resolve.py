"""The family facts of one model, resolved to module names: what ``ModelFacts`` holds of them.

Each function reads the model (module classes, parameters, the HF config) and the registered
families, never communicates, and raises ``ConfigError`` the same way on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.families.facts import AttentionKind, Family, LayerKind, SizeNames
from fsdp_turbo.core.families.hf import config_value, hf_layer_kinds, per_layer_attributes
from fsdp_turbo.core.families.linear_forms import recognise_linear_attention
from fsdp_turbo.core.families.registry import families, family_for
from fsdp_turbo.core.forms import class_names
from fsdp_turbo.core.patterns import match_modules

# HF's convention for a token mixer's class, beside the classes families name
ATTENTION_SUFFIX = "Attention"
# HF's names for a MoE block's router, beside the experts it routes to
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class AttentionLayer:
    """One token mixer: its module, its block's index and how it mixes."""

    name: str
    kind: AttentionKind
    index: int | None  # the index of its block among the repeated blocks (HF's layer_idx)
    window: int | None = None
    chunk: int | None = None
    declared: str = ""  # the config's name for its kind
    form: type | None = None  # linear: the form that reads it (None: no registered form does)
    kv_heads: int | None = None  # where the layer's own differ from the model's
    head_dim: int | None = None
    # the family's query scale by row index (Family.query_scales), if this module's queries get one
    query_scale: Callable[..., Any] | None = None


@dataclass(frozen=True)
class HeadParameterFact:
    module: str
    parameter: str
    dim: int
    what: str


@dataclass(frozen=True)
class LatentFact:
    module: str  # the latent module
    attention: str  # the attention it belongs to
    shared_tail: int = 0  # its last outputs every head reads directly


@dataclass(frozen=True)
class HeadsNormFact:
    module: str  # the norm over every head's channels
    attention: str
    projection: str  # the projection whose output it normalises


@dataclass(frozen=True)
class ModelSizes:
    """The sizes the features and estimates read; 0 or ``None`` where the model does not say."""

    hidden: int = 0
    layers: int = 0
    vocab: int = 0
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int = 0  # queries and keys
    v_head_dim: int = 0
    intermediate: int = 0
    moe_intermediate: int = 0
    experts: int = 0
    top_k: int = 0


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _outermost(names: Iterable[str]) -> list[str]:
    chosen: list[str] = []
    for name in names:  # model order: a holder comes before what it holds
        if not any(name.startswith(holder + ".") for holder in chosen):
            chosen.append(name)
    return chosen


def _module_classes(attribute: str) -> set[str]:
    return {cls for family in families() for cls in getattr(family, attribute)}


# ----- layers --------------------------------------------------------------------------------
def layer_kinds(model: nn.Module, layers: int) -> tuple[LayerKind, ...]:
    """One kind per repeated block: the model's family's ``layer_kinds``, else HF's."""
    config = _config(model)
    family = family_for(config)
    read = family.layer_kinds if family is not None and family.layer_kinds is not None else hf_layer_kinds
    kinds = tuple(read(config, layers)) if config is not None else ()
    return kinds + (LayerKind(),) * (layers - len(kinds))


def _is_mixer(module: nn.Module, classes: set[str]) -> bool:
    names = class_names(module)
    return type(module).__name__.endswith(ATTENTION_SUFFIX) or bool(names & classes)


def _owns_decay(module: nn.Module) -> bool:
    # A recurrent mixer's decay (Mamba, DeltaNet) is an A_log parameter: cut to a chunk, such a
    # mixer would silently see only that chunk, so it is a linear layer (kept whole by TP,
    # refused by CP until a form reads it), whatever its class is called.
    return isinstance(module._parameters.get("A_log"), nn.Parameter)


def attention_layers(model: nn.Module, blocks: Sequence[str]) -> tuple[AttentionLayer, ...]:
    """The model's token mixers, outermost, in model order, each with its kind: a module a
    linear-attention form recognises, a family's attention class, a class named
    ``...Attention`` (HF's convention) or a module holding a recurrent decay (``A_log``).
    Its block's index gives its layer kind; a mixer with a decay anywhere inside is linear."""
    kinds = layer_kinds(model, len(blocks))
    classes = _module_classes("attention_classes")
    found: list[AttentionLayer] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in taken):
            continue
        form = recognise_linear_attention(module)
        if form is None and not _is_mixer(module, classes) and not _owns_decay(module):
            continue
        taken.append(name)
        index = next((i for i, block in enumerate(blocks) if name.startswith(block + ".")), None)
        kind = kinds[index] if index is not None else LayerKind()
        recurrent = form is not None or any(_owns_decay(inner) for inner in module.modules())
        if recurrent and kind.kind is not AttentionKind.LINEAR:
            kind = LayerKind(AttentionKind.LINEAR, declared=kind.declared or "recurrent")
        scale = _query_scale(model, module)
        found.append(AttentionLayer(name, kind.kind, index, kind.window, kind.chunk, kind.declared, form,
                                    kind.kv_heads, kind.head_dim, scale))
    return tuple(found)


def _query_scale(model: nn.Module, module: nn.Module) -> Callable[..., Any] | None:
    family = family_for(_config(model))
    scales = family.query_scales if family is not None else None
    if scales is None or scales(module, torch.zeros(1, dtype=torch.long)) is None:
        return None
    return scales


# ----- per-head parameters, latents, norms over every head -----------------------------------
def _of_class(model: nn.Module, module_class: str) -> Iterable[tuple[str, nn.Module]]:
    return ((name, module) for name, module in model.named_modules() if module_class in class_names(module))


def head_parameters(model: nn.Module, configured: Sequence[str] | None) -> tuple[HeadParameterFact, ...]:
    """The families' per-head parameters present in the model, and ``model_facts.head_parameters``
    (patterns of ``module.parameter``, one entry per head along dim 0)."""
    found: dict[tuple[str, str], HeadParameterFact] = {}
    for family in families():
        for known in family.head_parameters:
            for name, module in _of_class(model, known.module_class):
                if isinstance(module._parameters.get(known.parameter), nn.Parameter):
                    found[(name, known.parameter)] = HeadParameterFact(name, known.parameter, known.dim,
                                                                       known.what or family.name)
    for pattern in configured or ():
        module_pattern, _, parameter = pattern.rpartition(".")
        field = "model_facts.head_parameters"
        if not module_pattern:
            raise ConfigError(field, pattern, "give 'module pattern.parameter', e.g. 'layers.*.attention.sinks'")
        for name, module in match_modules(model, [module_pattern], field=field).items():
            if not isinstance(module._parameters.get(parameter), nn.Parameter):
                raise ConfigError(field, pattern, f"name a parameter {name} holds itself "
                                  f"({sorted(module._parameters)})", reason=f"{name} holds no parameter {parameter!r}")
            found[(name, parameter)] = HeadParameterFact(name, parameter, 0, "configured")
    return tuple(found.values())


def _tail(attention: nn.Module, tail: int | str | None, where: str) -> int:
    if tail is None:
        return 0
    value = getattr(attention, tail, None) if isinstance(tail, str) else tail
    if not isinstance(value, int):
        raise ConfigError("model_facts.latent_modules", where, "state the shared tail as a number or an "
                          "attribute of the attention", reason=f"{type(attention).__name__} has no int {tail!r}")
    return value


def latent_modules(model: nn.Module, configured: Sequence[str] | None) -> tuple[LatentFact, ...]:
    """Modules whose output every head reads (MLA's latents): the families', and
    ``model_facts.latent_modules`` (patterns; no shared tail)."""
    found: dict[str, LatentFact] = {}
    for family in families():
        for known in family.latent_modules:
            for name, attention in _of_class(model, known.module_class):
                if isinstance(getattr(attention, known.child, None), nn.Module):
                    child = f"{name}.{known.child}"
                    found[child] = LatentFact(child, name, _tail(attention, known.shared_tail, child))
    for name in match_modules(model, configured, field="model_facts.latent_modules") if configured else {}:
        found[name] = LatentFact(name, name.rpartition(".")[0])
    return tuple(found.values())


def heads_norms(model: nn.Module) -> tuple[HeadsNormFact, ...]:
    """The families' norms over every head's channels of a projection (MiniMax-M2's q/k norms)."""
    found = []
    for family in families():
        for known in family.heads_norms:
            for name, attention in _of_class(model, known.module_class):
                if isinstance(getattr(attention, known.child, None), nn.Module):
                    found.append(HeadsNormFact(f"{name}.{known.child}", name, f"{name}.{known.projection}"))
    return tuple(found)


# ----- routers and indexers --------------------------------------------------------------------
def routers(model: nn.Module, configured: Sequence[str] | None) -> tuple[str, ...]:
    """The modules that route tokens to experts: ``model_facts.router_modules``' matches, else
    the families' router classes and HF's convention (a child ``gate`` or ``router`` beside a
    child ``experts``). By structure, so it holds whether expert parallel is installed or not."""
    if configured:
        return tuple(match_modules(model, configured, field="model_facts.router_modules", outermost=True))
    classes = _module_classes("routers")
    names = []
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if not name:
            continue
        holder = model.get_submodule(parent) if parent else model
        beside_experts = leaf in ROUTER_NAMES and isinstance(getattr(holder, "experts", None), nn.Module)
        if beside_experts or class_names(module) & classes:
            names.append(name)
    return tuple(_outermost(names))


def of_classes(model: nn.Module, attribute: str) -> tuple[str, ...]:
    """The outermost modules of the classes the families list under ``attribute`` (``indexers``,
    ``compressors``)."""
    classes = _module_classes(attribute)
    return tuple(_outermost(name for name, module in model.named_modules() if class_names(module) & classes))


# ----- sizes -----------------------------------------------------------------------------------
def _first(config: Any, names: Sequence[str]) -> Any:
    """The first of ``names`` the config (or model) holds model-wide."""
    for name in names:
        value = config_value(config, name)
        if value is not None:
            return value
    return None


def _per_layer(config: Any, names: Sequence[str], pick: Callable[[list[int]], int]) -> int | None:
    """For a size a heterogeneous config holds per layer: ``pick`` of the layers' values."""
    for name in names:
        if name in per_layer_attributes(config):
            values = [v for i in range(len(config.per_layer_config)) if (v := config_value(config, name, i))]
            return pick(values) if values else None
    return None


def _most_common(values: list[int]) -> int:
    return max(set(values), key=values.count)


def model_sizes(model: nn.Module, layers: int, heads: int | None, kv_heads: int | None) -> ModelSizes:
    """The sizes the model's config holds, under its family's names (``Family.sizes`` /
    ``sizes_of``) or the common ones; ``heads`` / ``kv_heads`` as the facts resolved them."""
    config = _config(model)
    family: Family | None = family_for(config)
    names = family.sizes if family is not None else SizeNames()
    values: dict[str, Any] = {}
    if config is not None:
        for size in fields(SizeNames):
            if size.name not in ("heads", "kv_heads"):
                values[size.name] = _first(config, getattr(names, size.name)) or _per_layer(
                    config, getattr(names, size.name), _most_common)
        if family is not None and family.sizes_of is not None:
            values.update({k: v for k, v in family.sizes_of(config).items() if k not in ("heads", "kv_heads")})
    values = {k: int(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    values["layers"] = layers or values.get("layers", 0)
    if not values.get("head_dim") and heads and values.get("hidden"):
        values["head_dim"] = values["hidden"] // heads
    values.setdefault("v_head_dim", values.get("head_dim", 0))
    return ModelSizes(heads=heads, kv_heads=kv_heads, **values)


def head_counts(model: nn.Module, configured_heads: int | None, configured_kv: int | None
                ) -> tuple[int | None, int | None, str]:
    """(query heads, key/value heads, where from): configured, else the config under the family's
    names (``Family.sizes`` / ``sizes_of``) or the common ones."""
    config = _config(model)
    family = family_for(config)
    names = family.sizes if family is not None else SizeNames()
    extra = family.sizes_of(config) if family is not None and family.sizes_of is not None and config else {}
    # a model without an HF config may hold its own
    detected_heads = extra.get("heads") or _first(config, names.heads) or _first(model, names.heads)
    # per layer (a heterogeneous config): the fewest, which every split must divide
    detected_kv = (extra.get("kv_heads") or _first(config, names.kv_heads) or _per_layer(config, names.kv_heads, min)
                   or _first(model, names.kv_heads))
    heads = configured_heads if configured_heads is not None else detected_heads
    kv_heads = configured_kv or detected_kv or heads
    source = ("configured: model_facts.num_attention_heads" if configured_heads is not None
              else "detected: config" if heads is not None else "detected: none")
    return heads, kv_heads, source
