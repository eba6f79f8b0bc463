"""Hugging Face's conventions, for a model whose family states nothing else: the layer kinds
its config declares (``layer_types``, ``sliding_window``, ``attention_chunk_size``), and config
values read safely from a heterogeneous config (``per_layer_config``: values that differ by
layer, such as Gemma 4's global layers' head dim, which the config refuses to give model-wide)."""

from __future__ import annotations

from typing import Any

from fsdp_turbo.core.families.facts import AttentionKind, LayerKind

# transformers' layer_types entries and the kinds they mean
LAYER_TYPES = {
    "full_attention": AttentionKind.SOFTMAX,
    "sliding_attention": AttentionKind.SLIDING,
    "chunked_attention": AttentionKind.CHUNKED,
    "linear_attention": AttentionKind.LINEAR,
    "indexed_attention": AttentionKind.SPARSE,  # DeepSeek Sparse Attention: an indexer picks each query's keys
}


def per_layer_attributes(config: Any) -> frozenset[str]:
    """The attributes a heterogeneous config holds per layer (empty for a uniform one)."""
    if not getattr(config, "is_heterogeneous", False):
        return frozenset()
    return frozenset(getattr(config, "per_layer_attributes", None) or ())


def config_value(config: Any, name: str, layer: int | None = None) -> Any:
    """``config.name``; for an attribute a heterogeneous config holds per layer, layer
    ``layer``'s value (``None`` when no layer is named: there is no model-wide one)."""
    if name in per_layer_attributes(config):
        return None if layer is None else getattr(config.per_layer_config[layer], name, None)
    return getattr(config, name, None)


def declared_layer_kind(config: Any, declared: str, layer: int | None = None) -> LayerKind:
    """The kind a ``layer_types`` entry declares, with the window or chunk the config gives, and
    the layer's own head dim and key/value heads where the config holds them per layer."""
    kind = LAYER_TYPES.get(declared, AttentionKind.UNKNOWN)
    own = {}
    if layer is not None:
        for field, name in (("head_dim", "head_dim"), ("kv_heads", "num_key_value_heads")):
            if name in per_layer_attributes(config):
                own[field] = config_value(config, name, layer)
    if kind is AttentionKind.SLIDING:
        return LayerKind(kind, window=config_value(config, "sliding_window", layer), declared=declared, **own)
    if kind is AttentionKind.CHUNKED:
        return LayerKind(kind, chunk=config_value(config, "attention_chunk_size", layer), declared=declared, **own)
    return LayerKind(kind, declared=declared, **own)


def hf_layer_kinds(config: Any, layers: int) -> tuple[LayerKind, ...]:
    """One kind per layer: ``config.layer_types``; without it, a model-wide ``sliding_window``
    (unless ``use_sliding_window`` turns it off: Mistral's form), else softmax."""
    layer_types = list(getattr(config, "layer_types", None) or ())
    if layer_types:
        return tuple(declared_layer_kind(config, str(declared), index)
                     for index, declared in enumerate(layer_types[:layers]))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return (LayerKind(AttentionKind.SLIDING, window=window, declared="sliding_window"),) * layers
    return (LayerKind(),) * layers
