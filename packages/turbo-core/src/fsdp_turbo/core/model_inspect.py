"""Model facts every feature needs, read from structure rather than class names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.patterns import match_modules


def repeated_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's repeated blocks (e.g. decoder layers), by qualified name, in order.

    Hugging Face models name their block classes in ``_no_split_modules``; other
    models fall back to the children of their largest ``nn.ModuleList`` whose
    entries share one class.
    """
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    if block_classes:
        named = {n: m for n, m in model.named_modules() if n and type(m).__name__ in block_classes}
        outer = {n: m for n, m in named.items() if not any(n.startswith(p + ".") for p in named)}
        if outer:
            return outer
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    if best is None:
        return {}
    _, prefix, blocks = best
    return {f"{prefix}.{i}" if prefix else str(i): block for i, block in enumerate(blocks)}


def model_config_value(model: nn.Module, *names: str) -> Any:
    """The first of ``names`` present on ``model.config`` (HF) or the model; else ``None``."""
    for holder in (getattr(model, "config", None), model):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def attention_heads(model: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) as the model declares them, or ``None``."""
    heads = model_config_value(model, "num_attention_heads", "n_head", "num_heads")
    kv_heads = model_config_value(model, "num_key_value_heads", "n_kv_heads") or heads
    return heads, kv_heads


def output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the model's output head (HF ``get_output_embeddings()``), or ``None``."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return None
    name = next((n for n, m in model.named_modules() if m is head and n), None)
    return (name, head) if name is not None else None


def select_blocks(model: nn.Module, patterns: Sequence[str] | None, *, field: str) -> dict[str, nn.Module]:
    """A plan's outermost matches, else the repeated blocks: the modules a per-block
    feature (recompute, activation swap, compile) wraps. Raises ``ConfigError``; never
    communicates."""
    if patterns is not None:
        return match_modules(model, patterns, field=field, outermost=True)
    blocks = repeated_blocks(model)
    if not blocks:
        raise ConfigError(field, None, f"give {field}=['model.layers.*'] (or your block pattern)",
                          reason="the model has no recognisable repeated blocks to default to")
    return blocks
