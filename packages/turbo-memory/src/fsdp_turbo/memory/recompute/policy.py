"""Selective recompute: which ops keep their outputs, and the checkpoint policy built from them.

The default saves what is expensive to redo (matmuls, attention kernels) or must not
run twice (collectives), and recomputes the cheap element-wise ops around them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_turbo.core.errors import ConfigError

# On CPU an nn.Linear dispatches to aten.addmm (with bias) or aten.mm; DTensor
# collectives under TP/SP dispatch to the functional c10d ops and their waits.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_grouped_mm",
    "aten::_scaled_mm",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::wait_tensor",
)


def _canonical(name: str) -> str:
    """``aten.mm`` / ``aten::mm`` / ``torch.ops.aten.mm.default`` -> ``aten::mm`` (or ``aten::mm.default``)."""
    text = name.strip().removeprefix("torch.ops.")
    if "::" not in text:
        namespace, _, rest = text.partition(".")
        text = f"{namespace}::{rest}"
    return text


def _exists(canonical: str) -> bool:
    # The functional collectives register their ops on import.
    importlib.import_module("torch.distributed._functional_collectives")

    namespace, _, rest = canonical.partition("::")
    op, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace, None), op, None) if namespace and op else None
    if packet is None:
        return False
    return not overload or overload in packet.overloads()


def resolve_save_ops(names: Iterable[str], *, field: str = "recompute_policy") -> frozenset[str]:
    """Canonical op names; an unknown op is a ``ConfigError`` (no collective involved)."""
    resolved = set()
    for name in names:
        canonical = _canonical(name) if isinstance(name, str) else ""
        if not canonical or not _exists(canonical):
            raise ConfigError(field, name, "name ops as 'aten.mm' or 'aten::addmm' (see torch.ops)",
                              reason="no such operator")
        resolved.add(canonical)
    return frozenset(resolved)


def _default_save_ops() -> frozenset[str]:
    # Some kernels exist only in some torch builds; keep the ones this build has.
    return frozenset(name for name in DEFAULT_SAVE_OPS if _exists(name))


def _policy(save: frozenset[str], ctx, func, *args, **kwargs) -> CheckpointPolicy:
    packet = func.overloadpacket._qualified_op_name
    if packet in save or f"{packet}.{func._overloadname}" in save:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn(save_ops: Sequence[str] | None = None) -> Callable[[], tuple]:
    """A ``context_fn`` for non-reentrant checkpoint that saves ``save_ops`` (default:
    matmuls, attention and collectives) and recomputes everything else."""
    return context_fn_saving(_default_save_ops() if save_ops is None else resolve_save_ops(save_ops))


def context_fn_saving(save: frozenset[str]) -> Callable[[], tuple]:
    """The selective ``context_fn`` for ops already resolved by :func:`resolve_save_ops`."""
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, save))


def save_ops_for(policy: str | Sequence[str]) -> frozenset[str] | None:
    """``'full'`` -> None (save nothing); ``'selective'`` -> the default op list; a list -> those ops."""
    if policy == "full":
        return None
    if policy == "selective":
        return _default_save_ops()
    if isinstance(policy, str):
        raise ConfigError("recompute_policy", policy, "use 'full', 'selective' or a list of op names")
    return resolve_save_ops(tuple(policy))


def context_fn_for(policy: str | Sequence[str]) -> Callable[[], tuple] | None:
    """``'full'`` -> None (plain checkpoint); otherwise the selective ``context_fn``."""
    save = save_ops_for(policy)
    return None if save is None else context_fn_saving(save)
