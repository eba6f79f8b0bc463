"""The Ulysses attention wrapper, installed around whatever core attention a model uses.

Q/K/V arrive sequence-sharded (``[B, heads, S/cp, D]``, RoPE already applied with absolute
positions). One all-to-all takes them to head-sharded ``[B, heads/cp, S, D]``; the model's
own core attention (eager, sdpa, flash, ...) runs on the whole sequence for its heads; a
second all-to-all takes the output back to sequence-sharded. K/V heads are replicated when
there are fewer of them than CP ranks (GQA), so each rank holds the K/V its queries need.

Each attention module's window (sliding) or chunk comes from the model facts (the plan's
``LayerSpec``, looked up by the module HF passes first; else the ``sliding_window`` argument)
and goes into the full-sequence mask; the per-head parameters of the core attention the facts
name (gpt-oss's sinks) are cut to this rank's heads (:func:`heads_view`), so their gradient on
each rank is its heads' share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.hf import attention_function
from fsdp_turbo.distributed.context_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from fsdp_turbo.distributed.context_parallel.context import CPState
from fsdp_turbo.distributed.context_parallel.layer_masks import rescale_queries
from fsdp_turbo.distributed.context_parallel.ring_math import cut_to, to_width
from fsdp_turbo.distributed.context_parallel.sparse import gather_rows, gather_sequence, picked


def replicated_kv_heads(kv_heads: int, cp: int) -> int:
    """K/V heads after replication: the fewest (a multiple of ``kv_heads``) that split over cp."""
    return math.lcm(kv_heads, cp)


def replicate_kv(x: torch.Tensor, target: int) -> torch.Tensor:
    """Repeat each K/V head in place (``[k0, k0, k1, k1]``) so query head ``h`` still finds
    its K/V head at ``h // (heads / kv_heads)``."""
    return x if x.shape[1] == target else x.repeat_interleave(target // x.shape[1], dim=1)


class _HeadsView:
    """The attention module as a core attention over some of its heads sees it: the K/V
    group count after replication, and each per-head parameter (gpt-oss's ``sinks``, one
    logit per head) cut to those heads; every other attribute is the module's. A view, not a
    change to the module: the cut is a slice of the parameter, so its gradient flows back."""

    def __init__(self, module: nn.Module, overrides: dict[str, Any]) -> None:
        object.__setattr__(self, "_module", module)
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


# Per-head tensors HF's attention functions take as arguments (gpt-oss's flash path: ``s_aux``,
# its sinks); the ones they read from the module (its eager path: ``module.sinks``) are the
# model facts' per-head parameters (``LayerSpec.head_parameters``).
HEAD_ARGUMENTS = ("s_aux",)


def heads_view(module: nn.Module, groups: int, heads: slice, kwargs: dict[str, Any],
               head_parameters: tuple[str, ...] = ()) -> tuple[nn.Module | _HeadsView, dict[str, Any]]:
    """``module`` and ``kwargs`` as the core attention over query heads ``heads`` must see
    them (unchanged when nothing differs)."""
    overrides: dict[str, Any] = {}
    if getattr(module, "num_key_value_groups", groups) != groups:
        overrides["num_key_value_groups"] = groups
    for name in head_parameters:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor):
            overrides[name] = value[heads]
    kwargs = {k: (v[heads] if k in HEAD_ARGUMENTS and isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    return (_HeadsView(module, overrides) if overrides else module), kwargs


def full_causal_mask(seq_len: int, padding: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                     additive: bool, documents: torch.Tensor | None = None,
                     window: int | None = None, chunks: torch.Tensor | None = None,
                     selected: torch.Tensor | None = None) -> torch.Tensor | None:
    """The full-sequence mask the core attention needs: ``None`` where ``is_causal`` suffices
    (non-eager, no padding, one document per row, no window, no chunks), else boolean (True =
    attend) or additive ``[B or 1, 1, S, S]``. ``documents`` (packed rows) keeps attention inside
    each document; ``window`` (a sliding-window layer) within the last ``window`` positions, as
    transformers' ``sliding_window_overlay``: key ``k`` is seen by query ``q`` when
    ``q - window < k <= q``; ``chunks`` (a chunked layer: each token's block, ``[B or 1, S]``)
    within the query's block; ``selected`` (a sparse layer's picks, ``[B, 1, S, S]``) to those."""
    if padding is None and documents is None and window is None and chunks is None and selected is None \
            and not additive:
        return None
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        allowed = allowed.triu(1 - window)
    allowed = allowed[None, None]
    if chunks is not None:
        chunks = chunks.to(device)
        allowed = allowed & (chunks[:, None, :, None] == chunks[:, None, None, :])
    if selected is not None:
        allowed = allowed & selected.to(device)
    if padding is not None:
        allowed = allowed & padding[:, None, None, :].to(device)
    if documents is not None:
        documents = documents.to(device)
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def _with_entries(mask: torch.Tensor | None, entries: torch.Tensor, seq_len: int, device: torch.device) -> torch.Tensor:
    """The tokens' mask ``[B or 1, 1, S, S]`` (None: causal) with the entries' columns ``[B, 1, S, T]``
    (additive, as the model builds them) after it, in the tokens' mask's form."""
    if mask is None:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    entries = entries.to(device)
    entries = entries == 0 if mask.dtype == torch.bool else entries.to(mask.dtype)
    return torch.cat([mask.expand(entries.shape[0], -1, -1, -1), entries], dim=-1)


def ulysses_hf_attention(state: CPState, inner: str, core: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """An HF attention function (``AttentionInterface`` signature) that runs ``inner``
    (an implementation name such as ``"sdpa"``) on the whole sequence; or, hybrid, on
    the ring member's part of it, where ``core`` (the ring) covers the rest."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        if state.current is None:
            raise RuntimeError("context-parallel attention ran outside a context-parallel forward")
        context = state.current
        context.attention_calls += 1
        spec = state.spec(module)
        window = kwargs.get("sliding_window") or spec.window
        indices = kwargs.pop("indices", None)  # a sparse attention's picks (sparse.py)
        query = rescale_queries(spec, module, query, context)
        cp, group = state.ulysses_size, state.ulysses_group
        kv_heads = replicated_kv_heads(key.shape[1], cp)
        # Keys longer than the queries: entries every rank holds whole after its tokens (a compressed
        # attention's), their visibility the mask's last columns; they do not travel (sparse.py).
        extra = key.shape[2] - query.shape[2]
        entries = None
        if extra > 0:
            entries = key[:, :, -extra:], value[:, :, -extra:], gather_rows(attention_mask[..., -extra:], state)
            key, value = key[:, :, :-extra], value[:, :, :-extra]
        # One all-to-all for Q, K and V: split [q heads | k heads | v heads] per rank group. Values
        # of another width than queries and keys (MLA's) are padded with zeros to travel with them.
        qk_width, value_width = query.shape[-1], value.shape[-1]
        width = max(qk_width, value_width)
        query, key, value = (to_width(t, width) for t in (query, key, value))
        qkv = torch.cat([query, replicate_kv(key, kv_heads), replicate_kv(value, kv_heads)], dim=1)
        heads = query.shape[1]
        parts = [heads // cp, kv_heads // cp, kv_heads // cp]
        per_rank = torch.cat([t.unflatten(1, (cp, -1)) for t in qkv.split([heads, kv_heads, kv_heads], 1)], 2)
        gathered = sequence_to_heads(per_rank.flatten(1, 2), group, cp)
        q, k, v = gathered.split(parts, dim=1)
        q, k, v = cut_to(q, qk_width), cut_to(k, qk_width), cut_to(v, value_width)
        if entries is not None:
            my_kv = slice(state.ulysses_rank * parts[1], (state.ulysses_rank + 1) * parts[1])
            k, v = (torch.cat([x, replicate_kv(e, kv_heads)[:, my_kv]], dim=2) for x, e in ((k, entries[0]),
                                                                                            (v, entries[1])))
        # this rank now holds query heads [rank * heads/cp, (rank + 1) * heads/cp) of the whole sequence
        mine = slice(state.ulysses_rank * parts[0], (state.ulysses_rank + 1) * parts[0])
        view, kwargs = heads_view(module, heads // kv_heads, mine, kwargs, spec.head_parameters)
        if core is not None:  # the member's queries: its picks and its entries' mask rows gathered with them
            if indices is not None:
                kwargs["indices"] = gather_sequence(indices, state)
            out, _ = core(view, q, k, v, None if entries is None else entries[2], **kwargs)
            return heads_to_sequence(out, group, cp), None
        function = attention_function(inner, module)
        # flash kernels take the window as an argument (HF passes sliding_window on); the others read the mask
        chunks = context.chunk_ids(spec.chunk) if spec.chunk else None
        selected = picked(indices, state, context.seq_len) if indices is not None else None
        mask = full_causal_mask(context.seq_len, context.padding_mask, q.dtype, q.device, additive=inner == "eager",
                                documents=context.documents, window=None if inner.startswith("flash") else window,
                                chunks=chunks, selected=selected)
        if entries is not None:
            mask = _with_entries(mask, entries[2], context.seq_len, q.device)
        out, _ = function(view, q, k, v, mask, **kwargs)
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
