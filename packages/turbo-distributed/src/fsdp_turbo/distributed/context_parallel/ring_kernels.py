"""The ring's two block kernels, through the op registry: ``cp.ring_block_forward`` gives
a block's (output, lse), ``cp.ring_block_backward`` its (dQ, dK, dV) from the final output
and lse. ``causal``: the tile is a diagonal one (the same positions on both sides), so the
kernel can skip its upper half instead of reading a mask.

The portable kernels are ``ring_math``'s, which build the block's score matrix. On CPU,
torch's flash-attention op for CPU (``_scaled_dot_product_flash_attention_for_cpu`` and
its backward, which return and take the log-sum-exp) computes the same numbers without
that matrix. It wants an additive mask of the query's dtype, and it reports ``lse = 0``
for a query row that sees no key of the block: such rows are set to ``-inf`` (and their
output to 0) here, so the merge ignores them.

``attend_tiles`` and ``tile_grads`` run a source's tiles (``blocks.Tile``) through them, the
tiles of one shape and kind in one call (stacked along the batch dimension): the ring and the
KV all-gather differ only in how the keys and values arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.distributed.context_parallel.blocks import Tile
from fsdp_turbo.distributed.context_parallel.ring_math import block_attention, block_grads, merge

FORWARD = "cp.ring_block_forward"
BACKWARD = "cp.ring_block_backward"

def _causal(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]


@register_op(FORWARD)
def portable_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                     causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return block_attention(q, k, v, scale, _causal(q, k) if causal else mask)


@register_op(BACKWARD)
def portable_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                      out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return block_grads(q, k, v, scale, _causal(q, k) if causal else mask, out, lse, grad_out)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


@register_op(FORWARD, "cpu")
def cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    if mask is not None:
        blind = ~mask.any(-1)  # [B or 1, 1, Sq]: rows that see nothing here
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind[..., None], 0.0)
    return out, lse


@register_op(BACKWARD, "cpu")
def cpu_flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                       out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the kernel takes contiguous tensors only (grad_out comes from a transpose)
    grad_out, q, k, v, out, lse = (t.contiguous() for t in (grad_out, q, k, v, out, lse))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    return grads[0], grads[1], grads[2]


def expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: each K/V head serves ``groups`` query heads. Chunks travel unexpanded."""
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``expand``: the query heads' shares summed per K/V head."""
    return grad.unflatten(1, (-1, groups)).sum(2) if groups > 1 else grad


def _keys(tile, offset: int) -> slice:
    # a chunk that arrived trimmed to its shipped rows: tile slices count from the whole chunk
    return tile.k if not offset else slice(tile.k.start - offset, tile.k.stop - offset)


def _flip(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    # a reversed tile's rows and keys in reverse order: its upper triangle becomes causal's lower one
    return x.flip(dim)


def _same(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    return x


def _span(part: slice, length: int) -> range:
    return range(*part.indices(length))


def _overlaps(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


@dataclass
class _Batch:
    """Tiles of one shape and kind (causal, reversed, masked or not) on distinct query rows:
    one kernel call runs them all, each tile one entry of the call's batch dimension."""

    tiles: list[Tile]
    rows: list[range]  # each tile's query rows
    keys: list[range]  # each tile's key rows, in the chunk as it arrived


def _index(spans: list[range], device: torch.device) -> torch.Tensor | slice:
    """A batch's rows as one slice (a single tile: views, no copy) or an index of them all."""
    if len(spans) == 1:
        return slice(spans[0].start, spans[0].stop)
    return torch.tensor([i for span in spans for i in span], dtype=torch.long, device=device)


def _batches(tiles: list[Tile], queries: int, keys: int, offset: int) -> list[_Batch]:
    """``tiles`` grouped for batched kernel calls. A window or packed documents cut a chunk into
    many small tiles of a few shapes (a window: each query block's lower edge, full keys and
    diagonal), and one call per tile spends more on the call than on the block. A tile joins
    the first batch of its shape and kind none of whose query rows it shares (the forward
    merges each batch's output rows in one write)."""
    batches: dict[tuple, list[_Batch]] = {}
    for tile in tiles:
        rows, span = _span(tile.q, queries), _span(_keys(tile, offset), keys)
        mask = None if tile.mask is None else tuple(tile.mask.shape)
        kind = (len(rows), len(span), tile.causal, tile.reverse, mask)
        found = next((b for b in batches.get(kind, []) if not any(_overlaps(rows, r) for r in b.rows)), None)
        if found is None:
            batches.setdefault(kind, []).append(found := _Batch([], [], []))
        found.tiles.append(tile)
        found.rows.append(rows)
        found.keys.append(span)
    return [batch for kind in batches.values() for batch in kind]


def _stack(x: torch.Tensor, index: torch.Tensor | slice, count: int) -> torch.Tensor:
    """``x[:, :, index]`` with its ``count`` tiles moved into the batch dimension:
    ``[B, H, count * L, ...]`` to ``[count * B, H, L, ...]``."""
    part = x[:, :, index]
    return part if count == 1 else part.unflatten(2, (count, -1)).movedim(2, 0).flatten(0, 1)


def _unstack(x: torch.Tensor, count: int) -> torch.Tensor:
    """``_stack``'s inverse: ``[count * B, H, L, ...]`` to ``[B, H, count * L, ...]``."""
    return x if count == 1 else x.unflatten(0, (count, -1)).movedim(0, 2).flatten(2, 3)


def _masks(batch: _Batch, size: int) -> torch.Tensor | None:
    """The batch's masks, ``[count * B, 1, Lq, Lk]`` (each tile's broadcast over the batch)."""
    masks = [tile.mask for tile in batch.tiles]
    if masks[0] is None or len(masks) == 1:
        return masks[0]
    return torch.stack([m.expand(size, *m.shape[1:]) for m in masks]).flatten(0, 1)


def start_partials(q: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and lse before any block: nothing, or (attention sinks) the sink as the first
    partial of every row (output 0, lse its logit)."""
    out = torch.zeros_like(q)
    if sinks is None:
        return out, torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
    return out, sinks.to(q.dtype)[None, :, None].expand(q.shape[:3]).clone()


def attend_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: list, out: torch.Tensor,
                 lse: torch.Tensor, offset: int = 0) -> None:
    """Merge one source's tiles into ``out`` and ``lse`` (in place); ``k``/``v`` that source's
    chunk (K/V heads), starting at its row ``offset``."""
    groups = q.shape[1] // k.shape[1]
    keys, values = expand(k, groups), expand(v, groups)
    for batch in _batches(tiles, q.shape[2], k.shape[2], offset):
        count, first = len(batch.tiles), batch.tiles[0]
        rows, cols = _index(batch.rows, q.device), _index(batch.keys, q.device)
        flip = _flip if first.reverse else _same
        block_out, block_lse = call_op(FORWARD, q.device.type, flip(_stack(q, rows, count)),
                                       flip(_stack(keys, cols, count)), flip(_stack(values, cols, count)), scale,
                                       _masks(batch, q.shape[0]), first.causal)
        block_out, block_lse = _unstack(flip(block_out), count), _unstack(flip(block_lse, -1), count)
        merged_out, merged_lse = merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        out[:, :, rows], lse[:, :, rows] = merged_out, merged_lse


def tile_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: list, out: torch.Tensor,
               lse: torch.Tensor, grad_out: torch.Tensor, grad_q: torch.Tensor, offset: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One source's tiles' gradients: adds their dQ into ``grad_q`` and returns that source's
    dK and dV (K/V heads, the shape of ``k``)."""
    groups = q.shape[1] // k.shape[1]
    keys, values = expand(k, groups), expand(v, groups)
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for batch in _batches(tiles, q.shape[2], k.shape[2], offset):
        count, first = len(batch.tiles), batch.tiles[0]
        rows, cols = _index(batch.rows, q.device), _index(batch.keys, q.device)
        flip = _flip if first.reverse else _same
        dq, dk, dv = call_op(BACKWARD, q.device.type, flip(_stack(q, rows, count)), flip(_stack(keys, cols, count)),
                             flip(_stack(values, cols, count)), scale, _masks(batch, q.shape[0]),
                             flip(_stack(out, rows, count)), flip(_stack(lse, rows, count), -1),
                             flip(_stack(grad_out, rows, count)), first.causal)
        dq, dk, dv = (_unstack(flip(t), count) for t in (dq, dk, dv))
        if count == 1:
            grad_q[:, :, rows] += dq
            grad_k[:, :, cols] += fold(dk, groups)
            grad_v[:, :, cols] += fold(dv, groups)
        else:  # keys of a batch's tiles may overlap: index_add sums every share
            grad_q.index_add_(2, rows, dq)
            grad_k.index_add_(2, cols, fold(dk, groups))
            grad_v.index_add_(2, cols, fold(dv, groups))
    return grad_k, grad_v
