"""Ring attention over a CP group: K/V chunks travel around the ring, queries stay.

Forward: at step ``s`` a rank holds the K/V chunk of rank ``(rank - s) % cp``; it starts
sending that chunk on to ``rank + 1`` (and receiving the next from ``rank - 1``), computes
the block meanwhile, and merges it into its output by log-sum-exp (``ring_math``).

Backward, the same ring again: the K/V chunks travel as in the forward, and behind each
one its dK/dV sums: every rank adds its block's gradients to the sums it received and
passes them on; after ``cp`` hops they are home, complete. Both transfers are started a
block ahead (the sums travel while the next block is computed), so only the last hop home
is exposed. dQ stays local. Only the final output and lse are kept from the forward.

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

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.ops import call_op
from fsdp_turbo.distributed.context_parallel.layer_masks import rescale_queries
from fsdp_turbo.distributed.context_parallel.ring_kernels import BACKWARD, FORWARD
from fsdp_turbo.distributed.context_parallel.ring_math import merge, sink_grad, visible


def _exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup, hops: int = 1
              ) -> tuple[list[torch.Tensor], list]:
    """Start sending ``tensors`` ``hops`` ranks on and receiving those of the rank ``hops``
    back (1: the next and the previous rank); returns the receive buffers and the requests
    to wait on."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to_rank = dist.get_global_rank(group, (rank + hops) % size)
    from_rank = dist.get_global_rank(group, (rank - hops) % size)
    tensors = [t.contiguous() for t in tensors]  # P2P buffers must be contiguous, both ends
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to_rank, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, buffer, from_rank, group) for buffer in received]
    return received, dist.batch_isend_irecv(ops)


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: each K/V head serves ``groups`` query heads. Chunks travel unexpanded."""
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_expand``: the query heads' shares summed per K/V head."""
    return grad.unflatten(1, (-1, groups)).sum(2) if groups > 1 else grad


@dataclass(frozen=True)
class Tile:
    """A part of one block: this rank's queries ``q`` against the source's keys ``k`` (slices
    of the chunks), with its mask (None: every pair visible)."""

    q: slice
    k: slice
    mask: torch.Tensor | None
    causal: bool = False  # a diagonal tile: plain causal, no mask needed


ALL = slice(None)


def _tiles(entry: list[Tile] | torch.Tensor | None) -> list[Tile]:
    """A source's tiles; a bare mask (or None) is one tile over the whole block."""
    if isinstance(entry, list):
        return entry
    if entry is not None and not bool(entry.any()):
        return []
    return [Tile(ALL, ALL, entry)]


class RingAttention(torch.autograd.Function):
    """``out = softmax(q kᵀ · scale + mask) v`` over the whole sequence; q is this rank's
    chunk ``[B, H, S/cp, D]``, k and v ``[B, H_kv, S/cp, D]`` (H a multiple of H_kv: the
    ring carries K/V heads, not their GQA copies). ``blocks[source]`` says how this rank's
    queries see rank ``source``'s keys: a list of ``Tile``s (what is not in a tile is
    masked), or one mask (None: all visible). ``sinks``: one logit per head joined to every
    row (gpt-oss), or None. ``steps``: the chunks travel this many hops less one (a sliding
    window needs fewer than the ring's size; every rank passes the same number)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                scale: float, blocks: list, group: dist.ProcessGroup, steps: int | None = None) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        steps = steps or size
        groups = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q)
        if sinks is None:
            lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
        else:  # the sink is the first partial of every row: output 0, lse its logit
            lse = sinks.to(q.dtype)[None, :, None].expand(q.shape[:3]).clone()
        current = [k, v]
        for step in range(steps):
            pending = _exchange(current, group) if step + 1 < steps else None
            keys, values = _expand(current[0], groups), _expand(current[1], groups)
            for tile in _tiles(blocks[(rank - step) % size]):
                block_out, block_lse = call_op(FORWARD, q.device.type, q[:, :, tile.q], keys[:, :, tile.k],
                                               values[:, :, tile.k], scale, tile.mask, tile.causal)
                out[:, :, tile.q], lse[:, :, tile.q] = merge(out[:, :, tile.q], lse[:, :, tile.q], block_out,
                                                             block_lse)
            if pending is not None:
                received, requests = pending
                for request in requests:
                    request.wait()
                current = received
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.blocks, ctx.group, ctx.steps = scale, blocks, group, steps
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, blocks, scale, steps = ctx.group, ctx.blocks, ctx.scale, ctx.steps
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        groups = q.shape[1] // k.shape[1]
        grad_q = torch.zeros_like(q)
        current = [k, v]
        incoming = None  # the dK/dV sums of the chunk held next step, on their way from rank - 1
        for step in range(steps):
            # The next K/V chunk travels while this block's gradients are computed, and the
            # sums sent last step travel while this block is: neither transfer is waited on
            # before the work that hides it is done.
            pending = _exchange(current, group) if step + 1 < steps else None
            keys, values = _expand(current[0], groups), _expand(current[1], groups)
            grad_k, grad_v = torch.zeros_like(current[0]), torch.zeros_like(current[1])
            for tile in _tiles(blocks[(rank - step) % size]):
                dq, dk, dv = call_op(BACKWARD, q.device.type, q[:, :, tile.q], keys[:, :, tile.k],
                                     values[:, :, tile.k], scale, tile.mask, out[:, :, tile.q], lse[:, :, tile.q],
                                     grad_out[:, :, tile.q], tile.causal)
                grad_q[:, :, tile.q] += dq
                grad_k[:, :, tile.k] += _fold(dk, groups)
                grad_v[:, :, tile.k] += _fold(dv, groups)
            if incoming is not None:  # add the ranks before this one's shares of this chunk
                received, requests = incoming
                for request in requests:
                    request.wait()
                grad_k, grad_v = grad_k + received[0], grad_v + received[1]
            # every hop, the last one included: after it each chunk's sums are home, complete (a
            # shortened ring sends them home from the last rank that held the chunk: steps - 1 back)
            last = step + 1 == steps
            incoming = _exchange([grad_k, grad_v], group, hops=(1 - steps) % size if last else 1)
            if pending is not None:
                received, requests = pending
                for request in requests:
                    request.wait()
                current = received
        received, requests = incoming
        for request in requests:
            request.wait()
        grad_sinks = None if sinks is None else sink_grad(sinks.to(q.dtype), out, lse, grad_out).to(sinks.dtype)
        return grad_q, received[0], received[1], grad_sinks, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   blocks: list, group: dist.ProcessGroup, sinks: torch.Tensor | None = None,
                   steps: int | None = None) -> torch.Tensor:
    return RingAttention.apply(q, k, v, sinks, scale, blocks, group, steps)


def _runs(positions: torch.Tensor) -> list[slice]:
    """The runs of consecutive positions (zig-zag chunks: two), as slices of the chunk."""
    breaks = (torch.diff(positions) != 1).nonzero().flatten().add(1).tolist()
    edges = [0, *breaks, positions.numel()]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def _lower(part: torch.Tensor) -> torch.Tensor:
    square = torch.ones(part.shape[-2], part.shape[-1], dtype=torch.bool, device=part.device).tril()
    return square.expand_as(part)


def _ends(positions: torch.Tensor, run: slice) -> tuple[int, int]:
    return int(positions[run][0]), int(positions[run][-1])


def _unseen(q_ends: tuple[int, int], k_ends: tuple[int, int], window: int | None, chunk: int | None = None) -> bool:
    """No query of the run sees any key of the other: every key comes later, or (a sliding
    window) every key lies ``window`` or more positions before every query, or (a chunked
    layer whose blocks follow the positions: no packing or padding) every key lies in an
    earlier block than every query."""
    (q_first, q_last), (k_first, k_last) = q_ends, k_ends
    return (k_first > q_last or (window is not None and q_first - k_last >= window)
            or (chunk is not None and k_last // chunk < q_first // chunk))


def _tile(q_run: slice, k_run: slice, mine: torch.Tensor, theirs: torch.Tensor, context,
          device: torch.device, window: int | None = None, chunk: int | None = None) -> Tile | None:
    """How the queries of run ``q_run`` see the keys of run ``k_run``: None (not at all), or
    a Tile. Without documents or padding it is decided from the runs' ends alone, so no
    ``[S, S]`` mask is built for the whole chunk (at 16k tokens a ring member's would be
    64 MiB); otherwise from this tile's own mask. ``window``: a sliding-window layer's;
    ``chunk``: a chunked layer's block length."""
    (q_first, q_last), (k_first, k_last) = q_ends, k_ends = _ends(mine, q_run), _ends(theirs, k_run)
    plain = context.documents is None and context.padding_mask is None
    if _unseen(q_ends, k_ends, window, chunk if plain else None):
        return None
    inside = window is None or q_last - k_first < window  # no pair of the runs is out of the window
    one_block = chunk is None or k_first // chunk == q_last // chunk  # every pair in one block
    if plain and inside and one_block:
        if k_last <= q_first:
            return Tile(q_run, k_run, None)
        if (q_first, q_last) == (k_first, k_last):
            return Tile(q_run, k_run, None, causal=True)
    q_pos, k_pos = mine[q_run], theirs[k_run]
    documents = None if context.documents is None else context.documents.to(device)
    docs = (documents[:, q_pos], documents[:, k_pos]) if documents is not None else (None, None)
    allowed = visible(q_pos, k_pos, *docs, window=window)
    if chunk is not None:
        blocks = context.chunk_ids(chunk).to(device)
        allowed = allowed & (blocks[:, q_pos][:, None, :, None] == blocks[:, k_pos][:, None, None, :])
    if context.padding_mask is not None:
        allowed = allowed & context.padding_mask.to(device)[:, k_pos][:, None, None, :]
    if not bool(allowed.any()):
        return None
    if bool(allowed.all()):
        return Tile(q_run, k_run, None)
    if (q_first, q_last) == (k_first, k_last) and torch.equal(allowed, _lower(allowed)):
        return Tile(q_run, k_run, None, causal=True)
    return Tile(q_run, k_run, allowed.contiguous())


def _joined(a: Tile, b: Tile) -> Tile | None:
    """Two fully visible tiles side by side (one query run, adjacent key runs, or the
    reverse) as one: the same work in one kernel call of twice the size."""
    if a.mask is not None or b.mask is not None or a.causal or b.causal:
        return None
    if a.q == b.q and a.k.stop == b.k.start:
        return Tile(a.q, slice(a.k.start, b.k.stop), None)
    if a.k == b.k and a.q.stop == b.q.start:
        return Tile(slice(a.q.start, b.q.stop), a.k, None)
    return None


def _join_full_tiles(tiles: list[Tile]) -> list[Tile]:
    # Zig-zag's off-diagonal blocks are two full tiles that share a run: one call each.
    joined = True
    while joined:
        joined = False
        for i, j in itertools.permutations(range(len(tiles)), 2):
            tile = _joined(tiles[i], tiles[j])
            if tile is not None:
                tiles = [t for n, t in enumerate(tiles) if n not in (i, j)] + [tile]
                joined = True
                break
    return tiles


def ring_tiles(context, rank: int, device: torch.device, window: int | None = None,
               chunk: int | None = None) -> list[list[Tile]]:
    """This rank's queries against every rank's keys, as tiles between runs of consecutive
    positions: causal by global position, within each packed document and the sliding
    window, never onto padding. A tile nothing sees is left out (zig-zag's saving, and a
    window's), one everything sees has no mask, and full tiles side by side are one."""
    positions = [p.to(device) for p in context.ring_positions]
    mine = positions[rank]
    blocks = []
    for theirs in positions:
        tiles = (_tile(q_run, k_run, mine, theirs, context, device, window, chunk)
                 for q_run in _runs(mine) for k_run in _runs(theirs))
        blocks.append(_join_full_tiles([tile for tile in tiles if tile is not None]))
    return blocks


def ring_steps(positions: list[torch.Tensor], window: int | None, chunk: int | None = None) -> int:
    """How many ring steps a layer needs (the same on every rank: it reads every member's
    positions): one past the last step at which some rank's queries can see the chunk it
    then holds (by position, window and blocks; documents and padding only hide more, so the
    caller passes ``chunk`` only where blocks follow the positions). Causal attention needs
    every step; a window or blocks shorter than the chunks, with contiguous chunks, only the
    previous rank's: the K/V stop travelling there, and so do their gradients."""
    if window is None and chunk is None:
        return len(positions)
    runs = [[_ends(p, run) for run in _runs(p)] for p in positions]
    size = len(positions)

    def seen(step: int) -> bool:
        return any(not _unseen(q, k, window, chunk) for rank in range(size)
                   for q in runs[rank] for k in runs[(rank - step) % size])

    return 1 + max(step for step in range(size) if seen(step))


def ring_core(state) -> Any:
    """The ring as an HF core attention: ``query [B, H, S_member, D]`` of this ring member
    (a pure ring: this rank's chunk; hybrid: its Ulysses group's, for H/ulysses heads).

    Under per-block compile it runs eagerly, one graph break per layer: dynamo does not
    trace P2P by default (each ``P2POp`` would break the graph), and the tiles are slices
    whose bounds depend on the positions' values."""

    @torch.compiler.disable
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        context = state.current
        if context is None:
            raise RuntimeError("context-parallel attention ran outside a context-parallel forward")
        if dropout and module.training:
            raise ConfigError("cp_plan.mode", state.mode, "set the model's attention_dropout to 0 under ring "
                              "context parallel", reason="ring attention has no dropout")
        if kwargs.get("softcap") is not None:
            raise ConfigError("cp_plan.mode", state.mode, "use mode 'ulysses' for this model",
                              reason="ring attention does not soft-cap its logits (softcap)")
        spec = state.spec(module)
        window, chunk, sinks = kwargs.get("sliding_window") or spec.window, spec.chunk, kwargs.get("s_aux")
        if (window, chunk) not in context.ring_tiles:  # the first layer of each mask kind builds them
            plain = context.documents is None and context.padding_mask is None
            context.ring_tiles[window, chunk] = (ring_tiles(context, state.ring_rank, query.device, window, chunk),
                                                 ring_steps(context.ring_positions, window, chunk if plain else None))
        tiles, steps = context.ring_tiles[window, chunk]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        # Values of another width than queries and keys (MLA's) are padded with zeros, which
        # change no score and no output column: the block kernels take one head size.
        value_width = value.shape[-1]
        width = max(query.shape[-1], value_width)
        query, key, value = (F.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
        # blocks in fp32 at least (fp64 stays): the merge and the recomputed backward are exact to rounding
        exact = torch.promote_types(query.dtype, torch.float32)
        out = ring_attention(query.to(exact), key.to(exact), value.to(exact), scale, tiles, state.ring_group,
                             sinks=None if sinks is None else sinks.to(exact), steps=steps)
        return out[..., :value_width].to(query.dtype).transpose(1, 2).contiguous(), None

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
