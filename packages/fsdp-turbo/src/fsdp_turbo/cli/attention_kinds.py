"""The kinds of attention a model holds, for ``fsdp-turbo plan``: softmax, sliding-window,
sinks and linear (a recurrent token mixer such as Gated DeltaNet), each with its modules and
what the features do with it.

Pure: it reads module classes, parameters and the Hugging Face config (``layer_types``,
``sliding_window``), and imports no feature package (the plan command shows, it does not plan).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from fsdp_turbo.cli.names import compress_names

# a token mixer by its class: transformers names its softmax attentions ``...Attention`` and its
# linear ones after the form (``Qwen3NextGatedDeltaNet``, ``...LinearAttention``)
_LINEAR_CLASS = re.compile(r"(DeltaNet|LinearAttention|Mamba)$")
_ATTENTION_CLASS = re.compile(r"Attention$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")

KINDS = ("softmax", "sliding", "sinks", "linear")

# What each feature does with each kind (as the feature packages implement it today).
FEATURE_EFFECTS = {
    "softmax": "cp: ulysses, ring or hybrid; tp: heads split by tp_plan",
    "sliding": "cp: masked by the window (ulysses), unseen tiles skipped (ring, hybrid); tp: heads split by tp_plan",
    "sinks": "cp: split with the heads (ulysses), joined once per row (ring); tp: the sinks split with their heads",
    "linear": ("cp: ulysses only (ring/hybrid refused; not beside tensor_parallel_size > 1); "
               "tp: kept whole, replicated (on the gathered sequence under sequence parallel)"),
}


def _layer_types(model: nn.Module) -> list[str]:
    return list(getattr(getattr(model, "config", None), "layer_types", None) or [])


def _layer_index(name: str) -> int | None:
    match = _LAYER_INDEX.search(name + ".")
    return int(match.group(1)) if match else None


def _is_mixer(module: nn.Module) -> bool:
    name = type(module).__name__
    return bool(_ATTENTION_CLASS.search(name) or _LINEAR_CLASS.search(name))


def _declared_kind(config: Any, layer_types: list[str], index: int | None) -> str | None:
    """The kind the config declares for the layer: its ``layer_types`` entry, else a model-wide
    ``sliding_window`` (unless ``use_sliding_window`` turns it off)."""
    if index is not None and index < len(layer_types):
        declared = str(layer_types[index])
        if "linear" in declared:
            return "linear"
        return "sliding" if "sliding" in declared else "softmax"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding"
    return None


def _module_kinds(name: str, module: nn.Module, config: Any, layer_types: list[str]) -> list[str]:
    """One module's kinds: linear, sliding or softmax, plus ``sinks`` when it holds a ``sinks``
    parameter (gpt-oss: one learned logit per head joined to the scores)."""
    declared = _declared_kind(config, layer_types, _layer_index(name))
    if _LINEAR_CLASS.search(type(module).__name__) or declared == "linear":
        kinds = ["linear"]
    else:
        kinds = [declared or "softmax"]
    if isinstance(getattr(module, "sinks", None), nn.Parameter):
        kinds.append("sinks")
    return kinds


def classify_attention(model: nn.Module) -> dict[str, list[str]]:
    """Kind -> the names of the attention modules of that kind, for the kinds the model has
    (ordered as ``KINDS``). A module with sinks is listed under ``sinks`` and under its window
    kind; a mixer nested in another mixer is part of it, not listed."""
    config = getattr(model, "config", None)
    layer_types = _layer_types(model)
    found: dict[str, list[str]] = {kind: [] for kind in KINDS}
    outer: list[str] = []
    for name, module in model.named_modules():
        if not _is_mixer(module) or any(name.startswith(prefix + ".") for prefix in outer):
            continue
        outer.append(name)
        for kind in _module_kinds(name, module, config, layer_types):
            found[kind].append(name)
    return {kind: names for kind, names in found.items() if names}


def attention_lines(model: nn.Module) -> list[str]:
    """The ``attention kinds`` block of the plan: one line per kind the model holds, its modules
    (``compress`` folds numbered names) and what each feature does with it."""
    kinds = classify_attention(model)
    if not kinds:
        return ["attention kinds: none found (no module class named ...Attention or a linear form)"]
    lines = ["attention kinds:"]
    for kind, names in kinds.items():
        lines.append(f"  {kind}: {', '.join(compress_names(names))} ({len(names)}) -> {FEATURE_EFFECTS[kind]}")
    return lines
