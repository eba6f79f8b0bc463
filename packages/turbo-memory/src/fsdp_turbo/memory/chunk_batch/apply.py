"""Run chosen modules' forward in batch slices (``chunk_batch``), without changing their names.

A module's forward is called once per slice of the batch and the outputs are joined, so the
forward's transient intermediates (an MLP's ``[tokens, intermediate]``, an attention's scores)
exist for one slice at a time. Under recompute the slices are recomputed one at a time too
(the slicing wraps the checkpointed forward), so the backward's re-run peak shrinks as well.
Rows of a batch are independent in a decoder block, so the result is the same as one call, up
to float32 summation order inside the GEMMs.

Which arguments are sliced: the batch is the first positional tensor's first dim (a decoder
block's ``hidden_states``). Every tensor argument, positional or keyword, at any depth of
tuples, lists and dicts, with two or more dims whose first is that batch is sliced along it
(hidden states, attention masks, position ids and embeddings); everything else goes whole to
every slice (1-D ``cache_position``, ``[1, S]`` position ids shared by the batch, flags).
Outputs are joined by position: tensors along dim 0, ``None`` stays ``None``; an output that
has no batch dim (a 0-dim tensor, a number) cannot be joined and raises. A training call drops
an HF layer's KV cache (each slice would write it); a call with a cache outside training
(generation) runs whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.memory.kv_cache import uses_kv_cache, without_kv_cache

CHUNK_BATCH_MARK = "_fsdp_turbo_chunk_batch"
_log = get_logger(__name__)


def _batch_of(args: tuple, kwargs: dict) -> int | None:
    first = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() >= 2 else None


def slice_batch(value: Any, batch: int, chunks: int) -> list[Any]:
    """``value`` for each of ``chunks`` slices of the batch (see the module docstring)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch:
        return list(torch.tensor_split(value, chunks))
    if isinstance(value, tuple | list):
        per_item = [slice_batch(item, batch, chunks) for item in value]
        return [type(value)(items[i] for items in per_item) for i in range(chunks)]
    if isinstance(value, dict):
        per_key = {key: slice_batch(item, batch, chunks) for key, item in value.items()}
        return [{key: items[i] for key, items in per_key.items()} for i in range(chunks)]
    return [value] * chunks


def join_batch(outputs: list[Any], where: str) -> Any:
    """One output from the slices' outputs (see the module docstring)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(f"chunk_batch: {where} returned a 0-dim tensor, which has no batch dim to join; "
                             "leave the module out of chunk_batch_plan.apply_modules")
        return torch.cat(outputs)
    if first is None:
        return None
    if isinstance(first, tuple | list):
        joined = [join_batch([o[i] for o in outputs], f"{where}[{i}]") for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else type(first)(joined)
    if isinstance(first, dict):  # transformers' ModelOutput is a dict too
        return type(first)(**{key: join_batch([o[key] for o in outputs], f"{where}.{key}") for key in first})
    raise ValueError(f"chunk_batch: {where} returned {type(first).__name__}, which cannot be joined over the "
                     "batch; leave the module out of chunk_batch_plan.apply_modules")


def _chunked_forward(module: nn.Module, name: str, num_chunks: int) -> None:
    forward = module.forward

    def chunked_forward(*args, **kwargs):
        if uses_kv_cache(kwargs):
            if not (module.training and torch.is_grad_enabled()):
                return forward(*args, **kwargs)  # a cache holds the whole batch (generation): no slices
            kwargs = without_kv_cache(kwargs)  # each slice would write it again
        batch = _batch_of(args, kwargs)
        chunks = min(num_chunks, batch or 1)
        if chunks < 2:
            warn_once(_log, f"chunk_batch: {name} got a batch of {batch or 'no'} rows; it runs whole")
            return forward(*args, **kwargs)
        sliced_args, sliced_kwargs = slice_batch(args, batch, chunks), slice_batch(kwargs, batch, chunks)
        outputs = [forward(*a, **k) for a, k in zip(sliced_args, sliced_kwargs, strict=True)]
        return join_batch(outputs, name)

    module.forward = chunked_forward
    object.__setattr__(module, CHUNK_BATCH_MARK, num_chunks)


def apply_chunk_batch(modules: dict[str, nn.Module] | Iterable[nn.Module], num_chunks: int = 2) -> None:
    """Run each module's forward in ``num_chunks`` slices of its batch (fewer when the batch has
    fewer rows). ``modules``: a ``{name: module}`` dict (names go into messages) or modules.
    The module call and its hooks (FSDP's all-gather, for one) run once, around all slices."""
    named = modules.items() if isinstance(modules, dict) else ((type(m).__name__, m) for m in modules)
    for name, module in named:
        if getattr(module, CHUNK_BATCH_MARK, None):
            raise ValueError(f"chunk_batch: {name} is already chunked")
        _chunked_forward(module, name, num_chunks)


def is_chunked(module: nn.Module) -> bool:
    return bool(getattr(module, CHUNK_BATCH_MARK, None))
