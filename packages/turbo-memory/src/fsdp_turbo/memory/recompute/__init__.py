"""Activation recompute: full or op-selective, on pattern-picked modules."""

from fsdp_turbo.memory.recompute.apply import apply_recompute, is_recomputed
from fsdp_turbo.memory.recompute.policy import DEFAULT_SAVE_OPS, resolve_save_ops, selective_context_fn
from fsdp_turbo.memory.recompute.transform import RecomputeTransform

__all__ = ["DEFAULT_SAVE_OPS", "RecomputeTransform", "apply_recompute", "is_recomputed", "resolve_save_ops",
           "selective_context_fn"]
