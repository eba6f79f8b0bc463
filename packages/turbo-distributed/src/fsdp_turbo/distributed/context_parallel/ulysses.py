"""The Ulysses attention wrapper, installed around whatever core attention a model uses.

Q/K/V arrive sequence-sharded (``[B, heads, S/cp, D]``, RoPE already applied with absolute
positions). One all-to-all takes them to head-sharded ``[B, heads/cp, S, D]``; the model's
own core attention (eager, sdpa, flash, ...) runs on the whole sequence for its heads; a
second all-to-all takes the output back to sequence-sharded. K/V heads are replicated when
there are fewer of them than CP ranks (GQA), so each rank holds the K/V its queries need.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.hf import attention_function
from fsdp_turbo.distributed.context_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from fsdp_turbo.distributed.context_parallel.context import CPState


def replicated_kv_heads(kv_heads: int, cp: int) -> int:
    """K/V heads after replication: the fewest (a multiple of ``kv_heads``) that split over cp."""
    return math.lcm(kv_heads, cp)


def replicate_kv(x: torch.Tensor, target: int) -> torch.Tensor:
    """Repeat each K/V head in place (``[k0, k0, k1, k1]``) so query head ``h`` still finds
    its K/V head at ``h // (heads / kv_heads)``."""
    return x if x.shape[1] == target else x.repeat_interleave(target // x.shape[1], dim=1)


@contextlib.contextmanager
def _kv_groups(module: nn.Module, groups: int) -> Iterator[None]:
    # HF's core attentions read num_key_value_groups to repeat K/V; replication changes it.
    old = getattr(module, "num_key_value_groups", None)
    if old is None or old == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = old


def full_causal_mask(seq_len: int, padding: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                     additive: bool, documents: torch.Tensor | None = None) -> torch.Tensor | None:
    """The full-sequence mask the core attention needs: ``None`` where ``is_causal`` suffices
    (non-eager, no padding, one document per row), else boolean (True = attend) or additive
    ``[B or 1, 1, S, S]``. ``documents`` (packed rows) keeps attention inside each document."""
    if padding is None and documents is None and not additive:
        return None
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    if padding is not None:
        allowed = allowed & padding[:, None, None, :].to(device)
    if documents is not None:
        documents = documents.to(device)
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def ulysses_hf_attention(state: CPState, inner: str, core: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """An HF attention function (``AttentionInterface`` signature) that runs ``inner``
    (an implementation name such as ``"sdpa"``) on the whole sequence; or, hybrid, on
    the ring member's part of it, where ``core`` (the ring) covers the rest."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        if state.current is None:
            raise RuntimeError("context-parallel attention ran outside a context-parallel forward")
        state.current.attention_calls += 1
        cp, group = state.ulysses_size, state.ulysses_group
        kv_heads = replicated_kv_heads(key.shape[1], cp)
        qkv = torch.cat([query, replicate_kv(key, kv_heads), replicate_kv(value, kv_heads)], dim=1)
        # One all-to-all for Q, K and V: split [q heads | k heads | v heads] per rank group.
        heads = query.shape[1]
        parts = [heads // cp, kv_heads // cp, kv_heads // cp]
        per_rank = torch.cat([t.unflatten(1, (cp, -1)) for t in qkv.split([heads, kv_heads, kv_heads], 1)], 2)
        gathered = sequence_to_heads(per_rank.flatten(1, 2), group, cp)
        q, k, v = gathered.split(parts, dim=1)
        context = state.current
        if core is not None:
            out, _ = core(module, q, k, v, None, **kwargs)
            return heads_to_sequence(out, group, cp), None
        function = attention_function(inner, module)
        mask = full_causal_mask(context.seq_len, context.padding_mask, q.dtype, q.device, additive=inner == "eager",
                                documents=context.documents)
        with _kv_groups(module, heads // kv_heads):
            out, _ = function(module, q, k, v, mask, **kwargs)
        return heads_to_sequence(out, group, cp), None

    return attention


def ulysses_core_attention(state: CPState, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """For non-HF models: wrap ``inner(query, key, value, *args, **kwargs)`` working on
    ``[B, heads, S, D]`` and returning the same layout (as ``F.scaled_dot_product_attention``),
    e.g. ``is_causal=True``; K/V heads are replicated when fewer than the Ulysses ranks.
    Hybrid: ``inner`` is the ring, over the ring member's part of the sequence."""

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        if state.current is not None:
            state.current.attention_calls += 1
            if state.current.documents is not None:  # the caller's mask would be the chunk's, not the documents'
                raise ConfigError("position_ids", "packed documents", "use an HF attn_implementation for packed "
                                  "sequences under context parallel, or one document per row",
                                  reason="a model_facts.attention_function gets no per-document mask")
        cp, group = state.ulysses_size, state.ulysses_group
        if query.shape[1] % cp:  # a non-HF model's heads are first seen here, before any collective
            raise ConfigError("context_parallel_size" if state.mode == "ulysses" else "cp_plan.ulysses_size", cp,
                              "use a Ulysses size that divides the attention heads, or cp_plan.mode='ring'",
                              reason=f"this attention has {query.shape[1]} query heads on each rank")
        kv_heads = replicated_kv_heads(key.shape[1], cp)
        q = sequence_to_heads(query, group, cp)
        k = sequence_to_heads(replicate_kv(key, kv_heads), group, cp)
        v = sequence_to_heads(replicate_kv(value, kv_heads), group, cp)
        out = inner(q, k, v, *args, **kwargs)  # [B, H/cp, S, D]
        return heads_to_sequence(out.transpose(1, 2), group, cp).transpose(1, 2)

    return attention
