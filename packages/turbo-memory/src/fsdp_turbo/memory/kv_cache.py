"""An HF layer's KV cache, for the features that call a layer's forward more than once."""

from __future__ import annotations

CACHE_KWARGS = ("past_key_values", "layer_past")


def uses_kv_cache(kwargs: dict) -> bool:
    """Whether a layer call passes a KV cache or asks to make one."""
    return any(kwargs.get(name) is not None for name in CACHE_KWARGS) or bool(kwargs.get("use_cache"))


def without_kv_cache(kwargs: dict) -> dict:
    """``kwargs`` with no cache and ``use_cache`` off. An HF layer writes its cache in forward, so
    a second call (a recompute, a batch slice) would write it again; training needs none (HF's
    own gradient checkpointing drops it too)."""
    kwargs = dict(kwargs)
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs
