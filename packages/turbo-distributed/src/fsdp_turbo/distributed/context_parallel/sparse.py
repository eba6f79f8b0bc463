"""DeepSeek's sparse and compressed attention under Ulysses.

**Sparse (DSA: DeepSeek-V3.2, GLM-MoE-DSA).**

A sparse layer's indexer scores each query against every earlier token and keeps the top
``index_topk``; the attention reads only those keys. Cut to a chunk, an indexer would pick among
its chunk's keys. Under Ulysses each rank computes its own queries' picks against the whole
sequence: transformers' DSA indexers take their keys through ``past_key_values.update_indexer``
(the decoding cache), so CP hands them a stand-in whose ``update_indexer`` returns every rank's
keys (an all-gather of one small key head per token; the indexer computes no gradient), and a
mask of what each of its queries may see (causal by global position, padding, documents). Its
picks, in global positions, reach the attention function as ``indices``; the Ulysses wrapper
gathers them over the sequence and masks the whole sequence's attention by them (:func:`picked`).

**Compressed (DeepSeek-V4).** A compressor makes extra key/value entries from the whole sequence
(softmax-gated sums over blocks of tokens, an indexer picking some of them per query) and the
attention appends them to its keys, with their visibility per query as the mask's last columns.
Under Ulysses each rank runs the compressor on the gathered sequence (an all-gather of its
input, whose backward sums every rank's share), so every rank holds every entry; it keeps its own
queries' rows of their mask. The Ulysses wrapper moves only the tokens' keys and values, then
appends the entries, and gathers the entries' mask rows (:func:`gather_rows`).

The model builds its own 4-D mask for these call sites, so CP registers the eager mask function
(additive: the entries' mask is added to it as transformers adds it) under its attention name
for such models (an unknown name gets none)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol

from fsdp_turbo.distributed.context_parallel.all_to_all import gather_chunks
from fsdp_turbo.distributed.context_parallel.context import CPState, ForwardContext


def gather_sequence(local: torch.Tensor, state: CPState) -> torch.Tensor:
    """``[B, s, ...]`` chunks of every Ulysses rank, in sequence order (no gradient): the ring or
    KV all-gather member's tokens (pure Ulysses: the whole sequence)."""
    return torch.cat(gather_chunks(local, state.ulysses_group), dim=1)


def gather_whole(local: torch.Tensor, state: CPState, *, autograd: bool = False) -> torch.Tensor:
    """``[B, s, ...]`` chunks of every CP rank as the whole sequence ``[B, S, ...]``, in its order
    (zig-zag chunks are put back in place). ``autograd``: the backward gives each rank its
    chunk's share, summed over ranks."""
    if autograd:
        whole = funcol.all_gather_tensor_autograd(local.contiguous(), 1, state.group)
    else:
        whole = torch.cat(gather_chunks(local, state.group), dim=1)
    order = state.current.sequence_order if state.current is not None else None
    return whole if order is None else whole[:, order.to(whole.device)]


class _EveryRanksKeys:
    """What the indexer takes for the decoding cache under CP: its keys become every rank's."""

    def __init__(self, state: CPState) -> None:
        self.state = state

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return gather_whole(keys, self.state)


def _visible(context: ForwardContext, device: torch.device) -> torch.Tensor:
    """``[B or 1, s, S]``: which of the whole sequence's keys each of this rank's queries may see."""
    rows = context.my_positions.to(device)
    allowed = (torch.arange(context.seq_len, device=device)[None, :] <= rows[:, None])[None]
    if context.padding_mask is not None:
        allowed = allowed & context.padding_mask.to(device)[:, None, :]
    if context.documents is not None:
        documents = context.documents.to(device)
        allowed = allowed & (documents[:, rows][:, :, None] == documents[:, None, :])
    return allowed


def _indexer_forward(original: Callable[..., Any], state: CPState, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                     position_embeddings: Any, attention_mask: Any = None, position_ids: Any = None,
                     past_key_values: Any = None, **kwargs: Any) -> torch.Tensor:
    # The model's own cache, if it built one, holds this forward's tokens only (a cache handed to the
    # model is refused by the input hook): the indexer's keys come from every rank instead.
    context = state.current
    if context is None:
        raise RuntimeError("context-parallel sparse attention ran outside a context-parallel forward")
    mask = _visible(context, hidden_states.device)
    return original(hidden_states, q_resid, position_embeddings, mask, position_ids,
                    past_key_values=_EveryRanksKeys(state), **kwargs)


def _compressor_forward(original: Callable[..., Any], state: CPState, hidden_states: torch.Tensor,
                        q_residual: torch.Tensor, position_ids: torch.Tensor, past_key_values: Any = None,
                        layer_idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    context = state.current
    if context is None:
        raise RuntimeError("context-parallel compressed attention ran outside a context-parallel forward")
    # the whole sequence on every rank; backward: each rank's chunk gets every rank's share
    whole = [gather_whole(x, state, autograd=True) for x in (hidden_states, q_residual)]
    positions = context.positions.to(position_ids.device)
    entries, bias = original(*whole, positions, None, layer_idx)  # stateless: the model's cache holds nothing yet
    rows = None if bias is None else bias[:, :, context.my_positions.to(bias.device)]
    return entries, rows


def install_compressors(model: nn.Module, names: Sequence[str], state: CPState) -> None:
    """Each compressor's forward (the instance's) runs on the gathered sequence."""
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(_compressor_forward, module.forward, state)


def gather_rows(rows: torch.Tensor, state: CPState) -> torch.Tensor:
    """``[B, 1, s, T]`` mask rows of this Ulysses rank's queries -> the whole sequence's ``[B, 1, S, T]``."""
    return gather_sequence(rows.transpose(1, 2), state).transpose(1, 2)


def install_indexers(model: nn.Module, names: Sequence[str], state: CPState) -> None:
    """Each indexer's forward (the instance's) scores this rank's queries against every rank's keys."""
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(_indexer_forward, module.forward, state)


def picked(indices: torch.Tensor, state: CPState, seq_len: int) -> torch.Tensor:
    """``indices [B, s, k]`` (this Ulysses rank's queries' picks, global positions) -> the whole
    sequence's ``[B, 1, S, S]`` mask of the picked keys."""
    every = gather_sequence(indices, state).long()
    return torch.zeros(*every.shape[:2], seq_len, dtype=torch.bool, device=indices.device).scatter_(
        -1, every, True)[:, None]
