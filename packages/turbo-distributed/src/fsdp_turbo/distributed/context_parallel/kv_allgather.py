"""KV all-gather attention over a CP group: queries stay, keys and values are gathered.

Forward: every rank all-gathers the group's K/V chunks (K/V heads, not their GQA copies),
then computes its queries against each source's chunk through the block map (``blocks``:
tiles the mask does not reach are skipped, cut tiles computed on the blocks they keep) and
merges the partials by log-sum-exp (``ring_math``). Backward: the K/V are gathered again
(keeping the whole sequence's K/V of every layer until the backward would cost a full
sequence's K/V per layer), each source's dK/dV are computed locally and one reduce-scatter
sums every rank's share into the chunk's owner. dQ stays local.

Against the ring: the same bytes (each rank receives every other chunk once), but in one
collective instead of ``cp - 1`` dependent hops, and every rank holds the whole sequence's
keys at once, which is what attention a ring cannot pass along needs: a window shorter than
a chunk (the ring also trims those), and attention whose keys depend on the whole sequence.
Load balancing (zig-zag chunks) evens out causal work as in the ring.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_turbo.distributed.context_parallel.all_to_all import gather_chunks
from fsdp_turbo.distributed.context_parallel.blocks import tiles_of
from fsdp_turbo.distributed.context_parallel.ring_kernels import attend_tiles, start_partials, tile_grads
from fsdp_turbo.distributed.context_parallel.ring_math import sink_grad


class KVAllGatherAttention(torch.autograd.Function):
    """``out = softmax(q kᵀ · scale + mask) v`` over the whole sequence; q is this rank's chunk
    ``[B, H, S/cp, D]``, k and v ``[B, H_kv, S/cp, D]``. ``blocks[source]`` and ``sinks`` as
    for ``RingAttention``. ``entry_k``/``entry_v`` ``[B, H_kv, T, D]``: keys every rank holds
    whole (a compressed attention's), attended after the sequence's under ``entry_mask``
    ``[B, 1, S/cp, T]``; their gradients stay on this rank (each rank made them from the whole
    sequence, whose gather sums the shares); or None."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                scale: float, blocks: list, group: dist.ProcessGroup, entry_k: torch.Tensor | None = None,
                entry_v: torch.Tensor | None = None, entry_mask: torch.Tensor | None = None) -> torch.Tensor:
        keys, values = gather_chunks(k, group), gather_chunks(v, group)
        out, lse = start_partials(q, sinks)
        for source, entry in enumerate(blocks):
            attend_tiles(q, keys[source], values[source], scale, tiles_of(entry), out, lse)
        if entry_k is not None:
            attend_tiles(q, entry_k, entry_v, scale, tiles_of(entry_mask), out, lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks, entry_k, entry_v)
        ctx.scale, ctx.blocks, ctx.group, ctx.entry_mask = scale, blocks, group, entry_mask
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, sinks, entry_k, entry_v = ctx.saved_tensors
        keys, values = gather_chunks(k, ctx.group), gather_chunks(v, ctx.group)
        grad_q = torch.zeros_like(q)
        grads = [tile_grads(q, keys[source], values[source], ctx.scale, tiles_of(entry), out, lse, grad_out, grad_q)
                 for source, entry in enumerate(ctx.blocks)]
        grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
        dist.reduce_scatter(grad_k, [g[0] for g in grads], group=ctx.group)
        dist.reduce_scatter(grad_v, [g[1] for g in grads], group=ctx.group)
        grad_entry_k = grad_entry_v = None
        if entry_k is not None:
            grad_entry_k, grad_entry_v = tile_grads(q, entry_k, entry_v, ctx.scale, tiles_of(ctx.entry_mask), out,
                                                    lse, grad_out, grad_q)
        grad_sinks = None if sinks is None else sink_grad(sinks.to(q.dtype), out, lse, grad_out).to(sinks.dtype)
        return grad_q, grad_k, grad_v, grad_sinks, None, None, None, grad_entry_k, grad_entry_v, None


def kv_allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, blocks: list,
                           group: dist.ProcessGroup, sinks: torch.Tensor | None = None,
                           entries: tuple | None = None) -> torch.Tensor:
    """``entries``: (keys, values, mask) every rank holds whole (a compressed attention's), or None."""
    return KVAllGatherAttention.apply(q, k, v, sinks, scale, blocks, group, *(entries or (None, None, None)))
