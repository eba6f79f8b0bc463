"""Which modules a ``QuantizeConfig`` converts, and with which converter. Raises, never mutates."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFacts, plain_api_facts
from fsdp_turbo.core.model_inspect import is_tuner_layer
from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.quantization.converter.registry import Converter, converter_names, get_converter
from fsdp_turbo.quantization.training.recipe import MXRecipe

FIELD = "quantization_plan"
FROZEN = "mx_frozen_linear"
FROZEN_EXPERTS = "mx_frozen_experts"
FROZEN_CONVERTERS = (FROZEN, FROZEN_EXPERTS)  # picked only with store_frozen_weights


@dataclass(frozen=True)
class Conversion:
    name: str  # the module
    converter: str  # the converter's registered name


def _inside(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def _converters(names: tuple[str, ...] | None) -> list[Converter]:
    chosen = []
    for name in names if names is not None else converter_names():
        converter = get_converter(name)
        if converter is None:
            raise ConfigError(f"{FIELD}.converters", name, f"use one of {list(converter_names())}",
                              reason="no converter by that name")
        chosen.append(converter)
    return chosen


def _default_exclusions(facts: ModelFacts) -> dict[str, str]:
    """Modules left high precision unless asked for: the model facts' output head, MoE routers
    and sparse-attention indexers (each with everything inside it)."""
    excluded: dict[str, str] = {}
    if facts.head is not None:
        excluded[facts.head] = "it is the output head (its error lands directly on the loss)"
    for name in facts.routers:
        excluded[name] = "it is an MoE router (routing decisions are precision-sensitive)"
    for name in facts.indexers:
        excluded[name] = "it is a sparse attention's indexer (its top-k picks are precision-sensitive)"
    return excluded


def _exclusion(excluded: Mapping[str, str], name: str) -> str | None:
    return next((why for holder, why in excluded.items() if _inside(name, holder)), None)


def plan_conversion(model: nn.Module, plan, facts: ModelFacts, *, unsuitable: Mapping[str, str] | None = None
                    ) -> tuple[list[Conversion], list[tuple[str, str]]]:
    """Resolve ``plan`` (a ``QuantizeConfig``) on ``model``.

    Default (no ``apply_modules``): every module a converter handles, except the output head
    (the model facts', ``model_facts.head_module`` where HF's API does not name it), routers, ``ignored_modules`` and
    modules whose dims do not divide the block (skipped).
    With ``apply_modules``: the convertible modules at or under each match; a head, a router
    or an unsupported module among them is a ConfigError (exclude it with ``ignored_modules``).
    ``unsuitable`` adds modules the caller knows cannot convert (name -> why), treated alike.
    Returns the conversions and the modules a converter handles but that are left out, each
    with why (``ignored_modules`` aside: those the user left out). Converting nothing at all
    is a ConfigError.
    """
    converters = _converters(plan.converters)
    recipe = MXRecipe.from_config(plan)
    ignored = (list(match_modules(model, plan.ignored_modules, field=f"{FIELD}.ignored_modules", outermost=True))
               if plan.ignored_modules else [])
    picked = (list(match_modules(model, plan.apply_modules, field=f"{FIELD}.apply_modules"))
              if plan.apply_modules is not None else None)
    excluded = {**_default_exclusions(facts), **(unsuitable or {})}
    conversions, skipped = [], []
    store_frozen = bool(getattr(plan, "store_frozen_weights", False))
    frozen_asked = [c for c in FROZEN_CONVERTERS if plan.converters is not None and c in plan.converters]
    if not store_frozen and frozen_asked:
        raise ConfigError(f"{FIELD}.converters", list(plan.converters), "set store_frozen_weights: true",
                          reason=f"{', '.join(frozen_asked)} store frozen weights in MX, which store_frozen_weights "
                                 "turns on")
    for name, module in model.named_modules():
        converter = next((c for c in converters if c.handles(module)), None)
        if converter is None or any(_inside(name, skip) for skip in ignored):
            continue
        if picked is not None and not any(_inside(name, p) for p in picked):
            continue
        if store_frozen:
            converter = _frozen_choice(model, name, module, converter, excluded)
            if converter is None:  # a trainable adapter: it trains in high precision
                continue
        problem = _exclusion(excluded, name) or converter.unsupported(module, recipe)
        if problem is not None:
            if picked is not None:
                raise ConfigError(f"{FIELD}.apply_modules", name, f"add {name!r} to ignored_modules",
                                  reason=f"{converter.name} cannot or should not convert it: {problem}")
            skipped.append((name, problem))
            continue
        conversions.append(Conversion(name, converter.name))
    if picked is not None and not conversions:
        raise ConfigError(f"{FIELD}.apply_modules", list(plan.apply_modules),
                          f"pick modules one of {[c.name for c in converters]} can convert",
                          reason="the patterns match no convertible module")
    if not conversions:
        left = "; ".join(f"{n}: {why}" for n, why in skipped[:4]) or "no module of a kind they convert"
        raise ConfigError(FIELD, plan.quant_format, "drop quantization_plan, or change block_size / ignored_modules "
                          "so that something converts", reason=f"it converts nothing ({left})")
    return conversions, skipped


def _in_tuner_layer(model: nn.Module, name: str) -> bool:
    parts = name.split(".")
    return any(is_tuner_layer(model.get_submodule(".".join(parts[:i]))) for i in range(1, len(parts)))


def _frozen_choice(model: nn.Module, name: str, module: nn.Module, converter: Converter,
                   excluded: Mapping[str, str]) -> Converter | None:
    """With ``store_frozen_weights``: the frozen-weight converter for a frozen Linear or frozen fused
    experts, None for a trainable adapter of a PEFT tuner layer (it stays high precision), else a
    ConfigError."""
    field = f"{FIELD}.store_frozen_weights"
    if converter.name in ("mx_experts", FROZEN_EXPERTS):
        return _frozen_experts_choice(model, name, module)
    if converter.name not in ("mx_linear", FROZEN):
        raise ConfigError(field, True, f"add {name!r} to ignored_modules, or drop store_frozen_weights",
                          reason=f"{converter.name} does not store frozen weights in MX (only Linears and fused "
                                 "experts do)")
    if not module.weight.requires_grad:
        return get_converter(FROZEN)
    if _in_tuner_layer(model, name) or _exclusion(excluded, name) is not None:
        return None
    raise ConfigError(field, True, f"freeze {name!r} (train adapters, e.g. PEFT LoRA, over it), add it to "
                      "ignored_modules, or drop store_frozen_weights",
                      reason=f"{name}.weight is trainable (full fine-tuning) and only frozen weights are stored MX")


def _frozen_experts_choice(model: nn.Module, name: str, module: nn.Module) -> Converter:
    """Frozen fused experts store their weights MX. LoRA on the experts themselves (PEFT
    ``target_parameters``) adds its delta to the base weights inside PEFT's forward, which would
    read packed bytes: refused, as are experts whose weights train."""
    field = f"{FIELD}.store_frozen_weights"
    if _in_tuner_layer(model, name):
        raise ConfigError(field, True, f"add {name!r} to {FIELD}.ignored_modules (its weights stay high precision "
                          "under the expert adapters), or drop the experts from LoraConfig.target_parameters",
                          reason=f"{name} has LoRA on its fused weights (PEFT target_parameters), which PEFT folds "
                                 "into the weights it reads, and frozen MX experts hold packed bytes there")
    trainable = [n for n in ("gate_up_proj", "down_proj") if getattr(module, n).requires_grad]
    if trainable:
        raise ConfigError(field, True, f"freeze {name!r} (train adapters elsewhere, e.g. PEFT LoRA on the "
                          "attention), add it to ignored_modules, or drop store_frozen_weights",
                          reason=f"{name}'s {', '.join(trainable)} train (full fine-tuning) and only frozen "
                                 "weights are stored MX")
    return get_converter(FROZEN_EXPERTS)


def apply_conversions(model: nn.Module, conversions: list[Conversion] | tuple[Conversion, ...],
                      recipe: MXRecipe) -> dict[str, str]:
    """Convert planned modules in place; returns ``{module name: converter name}``."""
    for conversion in conversions:
        get_converter(conversion.converter).convert(model.get_submodule(conversion.name), recipe)
    return {c.name: c.converter for c in conversions}


def convert_model(model: nn.Module, plan, facts: ModelFacts | None = None, *,
                  unsuitable: Mapping[str, str] | None = None) -> dict[str, str]:
    """Convert in place what ``plan`` (a ``QuantizeConfig``) picks; returns ``{module name: converter name}``.
    Without the facade, ``facts`` default to what the model says of itself."""
    facts = facts if facts is not None else plain_api_facts(model)
    conversions, _ = plan_conversion(model, plan, facts, unsuitable=unsuitable)
    return apply_conversions(model, conversions, MXRecipe.from_config(plan))
