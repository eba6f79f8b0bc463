"""Hugging Face's conventions, for a model whose family states nothing else: the layer kinds
its config declares (``layer_types``, ``sliding_window``, ``attention_chunk_size``)."""

from __future__ import annotations

from typing import Any

from fsdp_turbo.core.families.facts import AttentionKind, LayerKind

# transformers' layer_types entries and the kinds they mean
LAYER_TYPES = {
    "full_attention": AttentionKind.SOFTMAX,
    "sliding_attention": AttentionKind.SLIDING,
    "chunked_attention": AttentionKind.CHUNKED,
    "linear_attention": AttentionKind.LINEAR,
}


def declared_layer_kind(config: Any, declared: str) -> LayerKind:
    """The kind a ``layer_types`` entry declares, with the window or chunk the config gives."""
    kind = LAYER_TYPES.get(declared, AttentionKind.UNKNOWN)
    if kind is AttentionKind.SLIDING:
        return LayerKind(kind, window=getattr(config, "sliding_window", None), declared=declared)
    if kind is AttentionKind.CHUNKED:
        return LayerKind(kind, chunk=getattr(config, "attention_chunk_size", None), declared=declared)
    return LayerKind(kind, declared=declared)


def hf_layer_kinds(config: Any, layers: int) -> tuple[LayerKind, ...]:
    """One kind per layer: ``config.layer_types``; without it, a model-wide ``sliding_window``
    (unless ``use_sliding_window`` turns it off: Mistral's form), else softmax."""
    layer_types = list(getattr(config, "layer_types", None) or ())
    if layer_types:
        return tuple(declared_layer_kind(config, str(declared)) for declared in layer_types[:layers])
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return (LayerKind(AttentionKind.SLIDING, window=window, declared="sliding_window"),) * layers
    return (LayerKind(),) * layers
