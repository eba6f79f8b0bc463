"""Non-reentrant activation checkpointing on chosen modules, without changing their names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import checkpoint as checkpoint_function

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.memory.kv_cache import uses_kv_cache, without_kv_cache
from fsdp_turbo.memory.recompute.policy import context_fn_for

RECOMPUTE_MARK = "_fsdp_turbo_recompute"


def _drop_kv_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    # The recompute would write the layer's KV cache again and then attend over twice the keys.
    if not (module.training and torch.is_grad_enabled()) or not uses_kv_cache(kwargs):
        return None
    return args, without_kv_cache(kwargs)


def hooks_own_saved_tensors(module: nn.Module) -> bool:
    """Whether torch's composable ``checkpoint`` (applied by the user) holds this module's
    saved tensors with its own hooks around the module call. Our recompute does not: it
    wraps ``forward``, and the checkpoint saves the block's inputs as ordinary saved tensors,
    which an activation swap around the block can move."""
    state = checkpoint.state(module)
    return state is not None and bool(getattr(state, "enable_hook", False))


def is_recomputed(module: nn.Module) -> bool:
    """Whether activation checkpointing owns this module's saved tensors: ours, or torch's
    composable ``checkpoint`` applied by the user (it pushes its own saved-tensor hooks)."""
    return bool(getattr(module, RECOMPUTE_MARK, False)) or hooks_own_saved_tensors(module)


def _checkpoint_forward(module: nn.Module, context_fn: Callable[[], tuple] | None) -> None:
    forward = module.forward
    # Dynamo traces checkpoint's context_fn only when it builds selective contexts; the
    # plain (full) checkpoint must not name one.
    options = {"context_fn": context_fn} if context_fn else {}

    def checkpointed_forward(*args, **kwargs):
        return checkpoint_function(forward, *args, use_reentrant=False, **options, **kwargs)

    module.forward = checkpointed_forward


def apply_recompute(modules: Iterable[nn.Module], policy: str | Sequence[str] = "full") -> list[nn.Module]:
    """Checkpoint each module in place: its activations are recomputed in backward.

    Each module's ``forward`` is wrapped in non-reentrant ``torch.utils.checkpoint``; the
    module call and its hooks are not. So parameter names, ``state_dict`` keys and any
    later ``fully_shard`` on the same module are unchanged, and FSDP's hooks (all-gather,
    input casting) run outside the recomputed region, in forward and in the recompute
    alike. ``policy``: ``'full'``, ``'selective'`` or a list of op names to save.

    Why not torch's composable ``checkpoint`` (forward hooks): its recompute calls the
    module again, hooks included, so a selective policy met FSDP's mixed-precision
    input cast in the recompute but not in forward and refused to run. And dynamo traces
    ``torch.utils.checkpoint`` into a compiled forward (``compile=True``), so a selective
    policy applies to the compiled ops.
    """
    context_fn = context_fn_for(policy)
    modules = list(modules)
    for module in modules:
        check_not_recomputed(type(module).__name__, module)
    return checkpoint_modules(modules, context_fn)


def check_not_recomputed(name: str, module: nn.Module) -> None:
    if is_recomputed(module):
        raise ConfigError("recompute_plan", name, "apply recompute once per module",
                          reason="the module is already checkpointed")


def checkpoint_modules(modules: list[nn.Module], context_fn: Callable[[], tuple] | None) -> list[nn.Module]:
    """:func:`apply_recompute` once its inputs are checked and its policy resolved."""
    for module in modules:
        module.register_forward_pre_hook(_drop_kv_cache, with_kwargs=True)
        _checkpoint_forward(module, context_fn)
        setattr(module, RECOMPUTE_MARK, True)
    return modules
