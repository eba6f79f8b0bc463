"""Tensor, sequence and loss parallel on DTensor, picked by the shared patterns."""

from fsdp_turbo.distributed.tensor_parallel.loss import scoped_loss_parallel, vocab_parallel_cross_entropy
from fsdp_turbo.distributed.tensor_parallel.plan import (
    StyleChoice,
    StyleKind,
    TPPlan,
    build_style,
    resolve_tp_plan,
)
from fsdp_turbo.distributed.tensor_parallel.transform import TensorParallelTransform, apply_tp_plan

__all__ = [
    "StyleChoice",
    "StyleKind",
    "TPPlan",
    "TensorParallelTransform",
    "apply_tp_plan",
    "build_style",
    "resolve_tp_plan",
    "scoped_loss_parallel",
    "vocab_parallel_cross_entropy",
]
