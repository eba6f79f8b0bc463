"""Ring attention over a CP group: K/V chunks travel around the ring, queries stay.

Forward: at step ``s`` a rank holds the K/V chunk of rank ``(rank - s) % cp``; it starts
sending that chunk on to ``rank + 1`` (and receiving the next from ``rank - 1``), computes
the block meanwhile, and merges it into its output by log-sum-exp (``ring_math``).

Backward, the whole ring: the K/V chunks travel as in the forward, and behind each one
its dK/dV sums: every rank adds its block's gradients to the sums it received and passes
them on; after ``cp`` hops they are home, complete. Both transfers are started a block
ahead (the sums travel while the next block is computed), so only the last hop home is
exposed. dQ stays local. Only the final output and lse are kept from the forward.

A shortened ring (a sliding window, blocks or documents over contiguous chunks: fewer steps
than ranks) sends each rank's gradients of another's rows straight home instead, one
transfer per step started as soon as they are computed and waited on at the end: one
transfer and one wait per step fewer than passing the sums along. Where the rows it
received in the forward are few (at most ``KEEP_ROWS`` of the chunk: a 128-token window
over chunks of 1024 receives 127), the forward keeps them and the backward sends no K/V.

Masks come from the global positions (and documents) of both chunks, which every rank
knows from the full sequence the input splitter saw, so nothing but K/V and their
gradients crosses the ring.

Why not ``torch.distributed.tensor.experimental.context_parallel``: it shards the buffers
the caller names and patches ``scaled_dot_product_attention`` inside a context manager, so
the training loop must change; and its SDPA ring (torch 2.13,
``_context_parallel/_attention.py``) takes only ``is_causal``, no ``attn_mask`` (load
balancing requires ``is_causal``), so padding masks and packed documents could not be
honoured. Here the input hook and the HF attention interface already give us the sequence
and the call site.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.distributed.context_parallel.blocks import (
    ring_steps,
    ring_tiles,
    selected_tiles,
    shipped_rows,
    tiles_of,
)
from fsdp_turbo.distributed.context_parallel.kv_allgather import kv_allgather_attention
from fsdp_turbo.distributed.context_parallel.layer_masks import rescale_queries
from fsdp_turbo.distributed.context_parallel.ring_kernels import (
    attend_tiles,
    causal_costs_whole,
    start_partials,
    tile_grads,
)
from fsdp_turbo.distributed.context_parallel.ring_math import cut_to, sink_grad, to_width


def _exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, hops: int = 1, rows: int | None = None
              ) -> tuple[list[torch.Tensor], list]:
    """Start sending ``tensors`` ``hops`` ranks on and receiving those of the rank ``hops``
    back (1: the next and the previous rank); returns the receive buffers and the requests
    to wait on. ``rows``: the received tensors' length on dim 2, where it differs from the
    sent ones' (a chunk trimmed to its shipped rows)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to_rank = dist.get_global_rank(group, (rank + hops) % size)
    from_rank = dist.get_global_rank(group, (rank - hops) % size)
    tensors = [t.contiguous() for t in tensors]  # P2P buffers must be contiguous, both ends
    received = [t.new_empty((*t.shape[:2], t.shape[2] if rows is None else rows, *t.shape[3:])) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to_rank, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, buffer, from_rank, group) for buffer in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(pending: tuple[list[torch.Tensor], list]) -> list[torch.Tensor]:
    received, requests = pending
    for request in requests:
        request.wait()
    return received


def _send_on(current: list[torch.Tensor], step: int, source: int, group: dist.ProcessGroup,
             shipped: list[slice] | None) -> tuple[list[torch.Tensor], list]:
    """Start passing the K/V held at ``step`` (from rank ``source``) on to the next rank, and
    receiving the previous rank's: this rank's own chunk goes trimmed to its shipped rows."""
    rank, size, chunk = dist.get_rank(group), dist.get_world_size(group), current[0].shape[2]
    sending = current if step else [t[:, :, _span(shipped, rank, chunk)] for t in current]
    return _exchange(sending, group, rows=_length(shipped, (source - 1) % size, chunk))


def _span(shipped: list[slice] | None, source: int, rows: int) -> slice:
    return slice(0, rows) if shipped is None else shipped[source]


def _length(shipped: list[slice] | None, source: int, rows: int) -> int:
    span = _span(shipped, source, rows)
    return span.stop - span.start


# A shortened ring keeps the K/V rows its forward received for its backward when they are at
# most this share of its chunk: its saved K/V then grow by at most that much
KEEP_ROWS = 0.25


class RingAttention(torch.autograd.Function):
    """``out = softmax(q kᵀ · scale + mask) v`` over the whole sequence; q is this rank's
    chunk ``[B, H, S/cp, D]``, k and v ``[B, H_kv, S/cp, D]`` (H a multiple of H_kv: the
    ring carries K/V heads, not their GQA copies). ``blocks[source]`` says how this rank's
    queries see rank ``source``'s keys: a list of ``Tile``s (what is not in a tile is
    masked), or one mask (None: all visible). ``sinks``: one logit per head joined to every
    row (gpt-oss), or None. ``steps``: the chunks travel this many hops less one (a sliding
    window needs fewer than the ring's size; every rank passes the same number).
    ``shipped[source]``: the rows of that rank's chunk that travel (what other ranks' tiles
    read; ``blocks.shipped_rows``), or None: all of them."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                scale: float, blocks: list, group: dist.ProcessGroup, steps: int | None = None,
                shipped: list[slice] | None = None) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        steps, chunk = steps or size, k.shape[2]
        out, lse = start_partials(q, sinks)
        current, kept = [k, v], []
        # every rank decides alike (its peers send it K/V in the backward or not): by the most any receives
        received = max(sum(_length(shipped, (member - step) % size, chunk) for step in range(1, steps))
                       for member in range(size))
        keep = steps < size and received <= KEEP_ROWS * chunk
        for step in range(steps):
            source = (rank - step) % size
            if step + 1 < steps:  # the next chunk travels while this one is computed
                pending = _send_on(current, step, source, group, shipped)
            offset = _span(shipped, source, chunk).start if step else 0
            attend_tiles(q, current[0], current[1], scale, tiles_of(blocks[source]), out, lse, offset)
            if step + 1 < steps:
                current = _wait(pending)
                kept += current if keep else []
        ctx.save_for_backward(q, k, v, out, lse, sinks, *kept)
        ctx.scale, ctx.blocks, ctx.group, ctx.steps, ctx.shipped = scale, blocks, group, steps, shipped
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, sinks, *kept = ctx.saved_tensors
        group, blocks, scale, steps, shipped = ctx.group, ctx.blocks, ctx.scale, ctx.steps, ctx.shipped
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        grad_sinks = None if sinks is None else sink_grad(sinks.to(q.dtype), out, lse, grad_out).to(sinks.dtype)
        if steps < size:
            grad_q, grad_k, grad_v = _shortened_backward(q, k, v, kept, out, lse, grad_out, scale, blocks, group,
                                                         steps, shipped)
            return grad_q, grad_k, grad_v, grad_sinks, None, None, None, None, None
        chunk = k.shape[2]
        own = _span(shipped, rank, chunk)
        grad_q = torch.zeros_like(q)
        current = [k, v]
        home = None  # this rank's own chunk's dK/dV on the rows that never leave it
        incoming = None  # the dK/dV sums of the chunk held next step, on their way from rank - 1
        for step in range(steps):
            source = (rank - step) % size
            # The next K/V chunk travels while this block's gradients are computed, and the
            # sums sent last step travel while this block is: neither transfer is waited on
            # before the work that hides it is done.
            pending = None
            if step + 1 < steps:
                pending = _send_on(current, step, source, group, shipped)
            offset = _span(shipped, source, chunk).start if step else 0
            grad_k, grad_v = tile_grads(q, current[0], current[1], scale, tiles_of(blocks[source]), out, lse,
                                        grad_out, grad_q, offset)
            if step == 0:  # the own chunk: its shipped rows' sums travel, the rest stays home
                home = [grad_k.clone(), grad_v.clone()]
                for part in home:
                    part[:, :, own] = 0
                grad_k, grad_v = grad_k[:, :, own], grad_v[:, :, own]
            if incoming is not None:  # add the ranks before this one's shares of this chunk
                received = _wait(incoming)
                grad_k, grad_v = grad_k + received[0], grad_v + received[1]
            # every hop, the last one included: after it each chunk's sums are home, complete
            last = step + 1 == steps
            if size == 1:  # a ring of one: its sums are here (gloo has no pair to itself)
                incoming = ([grad_k, grad_v], [])
            else:
                incoming = _exchange([grad_k, grad_v], group,
                                     rows=_length(shipped, rank if last else (source - 1) % size, chunk))
            if pending is not None:
                current = _wait(pending)
        received = _wait(incoming)
        for part, sums in zip(home, received, strict=True):
            part[:, :, own] += sums
        return grad_q, home[0], home[1], grad_sinks, None, None, None, None, None


def _shortened_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: list[torch.Tensor],
                        out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, scale: float, blocks: list,
                        group: dist.ProcessGroup, steps: int, shipped: list[slice] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shortened ring's backward: each step's dK/dV go straight home (``s`` ranks back at
    step ``s``), while this rank's own rows' shares arrive from the ranks ahead; all are added
    at the end, in step order. The K/V rows of each step past the first are ``kept`` (K, V per
    step) from the forward, or travel again as in the forward (``kept`` empty)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    chunk = k.shape[2]
    own = _span(shipped, rank, chunk)
    grad_q = torch.zeros_like(q)
    current, arriving = [k, v], []
    for step in range(steps):
        source = (rank - step) % size
        pending = None
        if not kept and step + 1 < steps:  # the next chunk travels while this one's gradients are computed
            pending = _send_on(current, step, source, group, shipped)
        if kept and step:
            current = kept[2 * step - 2 : 2 * step]
        offset = _span(shipped, source, chunk).start if step else 0
        grad_k, grad_v = tile_grads(q, current[0], current[1], scale, tiles_of(blocks[source]), out, lse, grad_out,
                                    grad_q, offset)
        if step == 0:
            home = [grad_k, grad_v]
        else:  # to rank `source` (step back); from rank + step, its share of this rank's shipped rows
            arriving.append(_exchange([grad_k, grad_v], group, hops=-step, rows=own.stop - own.start))
        if pending is not None:
            current = _wait(pending)
    for transfer in arriving:
        for part, share in zip(home, _wait(transfer), strict=True):
            part[:, :, own] += share
    return grad_q, home[0], home[1]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   blocks: list, group: dist.ProcessGroup, sinks: torch.Tensor | None = None,
                   steps: int | None = None, shipped: list[slice] | None = None) -> torch.Tensor:
    return RingAttention.apply(q, k, v, sinks, scale, blocks, group, steps, shipped)


BLOCK_MAPS_KEPT = 8  # layouts whose block maps a model keeps (packed batches differ step by step)


def _build_block_map(state, context, device: torch.device, window: int | None, chunk: int | None) -> tuple:
    tiles = ring_tiles(context, state.ring_rank, device, window, chunk, block=state.block_size,
                       whole_blocks=causal_costs_whole(device.type))
    if state.mode == "kv_allgather":
        return tiles, None, None  # the KV all-gather gathers every chunk whole
    reach = chunk if context.documents is None and context.padding_mask is None else None
    starts = context.document_starts() if context.documents is not None else None
    return (tiles, ring_steps(context.ring_positions, window, reach, starts),
            shipped_rows(context.ring_positions, window, reach, starts))


def _block_map(state, context, device: torch.device, window: int | None, chunk: int | None) -> tuple:
    """This rank's tiles per source and, for the ring, its steps and each chunk's shipped rows,
    for one mask kind: built by the first layer of each kind in a forward, reused by the others,
    and by later forwards of the same layout (``CPState.block_maps``)."""
    if (window, chunk) not in context.ring_tiles:
        key = (context.layout_key(), str(device), window, chunk)
        block_map = state.block_maps.pop(key, None) or _build_block_map(state, context, device, window, chunk)
        state.block_maps[key] = block_map
        while len(state.block_maps) > BLOCK_MAPS_KEPT:
            state.block_maps.popitem(last=False)
        context.ring_tiles[window, chunk] = block_map
    return context.ring_tiles[window, chunk]


def ring_core(state) -> Any:
    """The ring (or, ``cp_plan.mode: kv_allgather``, the KV all-gather) as an HF core
    attention: ``query [B, H, S_member, D]`` of this member (alone: this rank's chunk; under
    Ulysses: its Ulysses group's, for H/ulysses heads).

    Under per-block compile it runs eagerly, one graph break per layer: dynamo does not
    trace P2P by default (each ``P2POp`` would break the graph), and the tiles are slices
    whose bounds depend on the positions' values."""
    what = "KV all-gather" if state.mode == "kv_allgather" else "ring"

    @torch.compiler.disable
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        context = state.current
        if context is None:
            raise RuntimeError("context-parallel attention ran outside a context-parallel forward")
        if dropout and module.training:
            raise ConfigError("cp_plan.mode", state.mode, f"set the model's attention_dropout to 0 under {what} "
                              "context parallel", reason=f"{what} attention has no dropout")
        if kwargs.get("softcap") is not None:
            raise ConfigError("cp_plan.mode", state.mode, "use mode 'ulysses' for this model",
                              reason=f"{what} attention does not soft-cap its logits (softcap)")
        spec = state.spec(module)
        window, chunk, sinks = kwargs.get("sliding_window") or spec.window, spec.chunk, kwargs.get("s_aux")
        tiles, steps, shipped = _block_map(state, context, query.device, window, chunk)
        if kwargs.get("indices") is not None:  # a sparse layer's picks: only those keys, per query
            tiles = selected_tiles(tiles, kwargs["indices"], context, state.ring_rank)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        # Values of another width than queries and keys (MLA's) are padded with zeros, which
        # change no score and no output column: the block kernels take one head size.
        value_width = value.shape[-1]
        width = max(query.shape[-1], value_width)
        query, key, value = (to_width(t, width) for t in (query, key, value))
        # blocks in fp32 at least (fp64 stays): the merge and the recomputed backward are exact to rounding
        exact = torch.promote_types(query.dtype, torch.float32)
        q, k, v = query.to(exact), key.to(exact), value.to(exact)
        sinks = None if sinks is None else sinks.to(exact)
        if state.mode == "kv_allgather":
            # keys past the queries' tokens: a compressed attention's entries, which every rank
            # holds whole, their visibility the mask's last columns (sparse.py)
            extra = key.shape[2] - query.shape[2]
            entries = None
            if extra > 0:
                rows = attention_mask[..., -extra:]
                entries = (k[:, :, -extra:], v[:, :, -extra:], rows if rows.dtype == torch.bool else rows == 0)
                k, v = k[:, :, :-extra], v[:, :, :-extra]
            out = kv_allgather_attention(q, k, v, scale, tiles, state.ring_group, sinks=sinks, entries=entries)
        else:
            out = ring_attention(q, k, v, scale, tiles, state.ring_group, sinks=sinks, steps=steps, shipped=shipped)
        return cut_to(out, value_width).to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


def ring_hf_attention(state) -> Any:
    """An HF attention function (``AttentionInterface`` signature) computing attention on
    the whole sequence by ring; the model's own mask is ignored (it covers the chunk only)."""
    core = ring_core(state)

    def attention(module, query, key, value, attention_mask, **kwargs):
        if state.current is not None:
            state.current.attention_calls += 1
            query = rescale_queries(state.spec(module), module, query, state.current)
        return core(module, query, key, value, attention_mask, **kwargs)

    return attention


def ring_sdpa(state, *, count_calls: bool = True) -> Any:
    """The ring as a core attention of ``F.scaled_dot_product_attention``'s form,
    ``(q, k, v, *, scale=None, is_causal=True, enable_gqa=False) -> [B, H, S, D]``, for
    non-HF models (``model_facts.attention_function`` / ``attention_modules``). It stands in
    for causal softmax attention and nothing else: a mask, dropout or ``is_causal=False``
    is refused, since the call it replaces is not run. ``count_calls``: False inside hybrid
    (the Ulysses wrapper around it counts)."""
    core = ring_core(state)

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = True,
                  scale: float | None = None, enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
        unsupported = [name for name, given in (("positional arguments", args), ("attn_mask", attn_mask is not None),
                                                ("dropout_p", dropout_p), ("is_causal=False", not is_causal),
                                                *((name, True) for name in sorted(kwargs))) if given]
        if unsupported:
            raise ConfigError("cp_plan.mode", state.mode, "use mode 'ulysses' for this attention",
                              reason=f"ring attention computes plain causal attention; the call also asked for "
                                     f"{unsupported}")
        if count_calls and state.current is not None:
            state.current.attention_calls += 1
        out, _ = core(None, query, key, value, None, scaling=scale)
        return out.transpose(1, 2)

    return attention
