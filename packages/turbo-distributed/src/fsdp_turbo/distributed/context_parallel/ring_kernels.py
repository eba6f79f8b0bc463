"""The ring's two block kernels, through the op registry: ``cp.ring_block_forward`` gives
a block's (output, lse), ``cp.ring_block_backward`` its (dQ, dK, dV) from the final output
and lse. ``causal``: the tile is a diagonal one (the same positions on both sides), so the
kernel can skip its upper half instead of reading a mask. K and V come with their own heads
(GQA: fewer than the queries', each serving ``H / H_kv`` of them) and so do dK and dV: the
ring carries K/V heads, and a kernel that wants a head per query head copies them itself.

The portable kernels are ``ring_math``'s, which build the block's score matrix. On CPU,
torch's flash-attention op for CPU (``_scaled_dot_product_flash_attention_for_cpu`` and
its backward, which return and take the log-sum-exp) computes the same numbers without
that matrix. It wants an additive mask of the query's dtype, and it reports ``lse = 0``
for a query row that sees no key of the block: such rows are set to ``-inf`` (and their
output to 0) here, so the merge ignores them.

``attend_tiles`` and ``tile_grads`` run a source's tiles (``blocks.Tile``) through them: the
ring and the KV all-gather differ only in how the keys and values arrive.
"""

from __future__ import annotations

import weakref

import torch

from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.distributed.context_parallel.ring_math import block_attention, block_grads, merge_into

FORWARD = "cp.ring_block_forward"
BACKWARD = "cp.ring_block_backward"

def _causal(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]


def expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: each K/V head serves ``groups`` query heads."""
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``expand``: the query heads' shares summed per K/V head."""
    return grad.unflatten(1, (-1, groups)).sum(2) if groups > 1 else grad


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[1] // k.shape[1]


@register_op(FORWARD)
def portable_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                     causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    groups = _groups(q, k)
    return block_attention(q, expand(k, groups), expand(v, groups), scale, _causal(q, k) if causal else mask)


@register_op(BACKWARD)
def portable_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                      out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = _groups(q, k)
    dq, dk, dv = block_grads(q, expand(k, groups), expand(v, groups), scale, _causal(q, k) if causal else mask,
                             out, lse, grad_out)
    return dq, fold(dk, groups), fold(dv, groups)


# The CPU flash kernels take fewer K/V heads than query heads (GQA) and return dK/dV per K/V
# head, with the same numbers as on expanded copies (pytorch#157893; verified on 2.13). Before
# that version the copies are made here. Natively, a rank with a 128-token window spent 44 ms
# on its own chunk's tiles a step instead of 47, with packed documents 33 instead of 43 (one
# thread): the copies of the whole chunk's K/V and the per-tile folds are gone.
NATIVE_GQA = torch.__version__ >= "2.13"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the CPU flash kernels read it. They take any strides but the last dimension's,
    which must be 1 (else the forward's numbers are wrong, with no error), so a tile's slice of a
    rank's queries or keys goes in as the view it is, not a contiguous copy (with copies, a
    64 x 192 tile of 16 heads took 0.71 ms forward and 1.54 ms backward, as views 0.56 and 1.31;
    a rank with a 128-token window runs 18 such tiles a step)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tile's mask as the CPU kernels take it: additive, of the queries' dtype. Made on each
    call, not kept: it is four times the boolean mask, and the block maps keep theirs for as
    many layouts as ``ring.BLOCK_MAPS_KEPT`` (one ``where``: half the time of filling zeros)."""
    additive = torch.where(mask, 0.0, float("-inf"))
    return additive if additive.dtype == dtype else additive.to(dtype)


# id(mask) -> its rows that see no key ([B or 1, 1, Sq]), or None where every row sees one
_BLIND: dict[int, torch.Tensor | None] = {}


def _blind_rows(mask: torch.Tensor) -> torch.Tensor | None:
    """The rows of a tile's mask that see no key, or None: found once per mask (a reduction
    and a check of it on every forward call cost as much as making the additive mask), kept
    while the mask lives (tiles live in block maps that every layer and step reuses)."""
    key = id(mask)
    if key not in _BLIND:
        blind = ~mask.any(-1)
        _BLIND[key] = blind if bool(blind.any()) else None
        weakref.finalize(mask, _BLIND.pop, key, None)
    return _BLIND[key]


@register_op(FORWARD, "cpu")
def cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    groups = 1 if NATIVE_GQA else _groups(q, k)
    q, k, v = _rows(q), _rows(expand(k, groups)), _rows(expand(v, groups))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
    blind = None if mask is None else _blind_rows(mask)
    if blind is not None:  # (most masked tiles have none: no copies of their output)
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind[..., None], 0.0)
    return out, lse


@register_op(BACKWARD, "cpu")
def cpu_flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                       out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = 1 if NATIVE_GQA else _groups(q, k)
    k, v = expand(k, groups), expand(v, groups)
    grad_out, q, k, v, out, lse = (_rows(t) for t in (grad_out, q, k, v, out, lse))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=None if mask is None else _additive(mask, q.dtype),
        scale=scale)
    return grads[0], fold(grads[1], groups), fold(grads[2], groups)


def causal_costs_whole(device_type: str) -> bool:
    """Whether this device's block kernel computes a small causal square as dearly as a full
    one. The CPU flash kernel skips only key blocks of its own split (hundreds of keys) past
    the diagonal: fed 64 x 64 tiles (one thread, 16 heads of 64, forward and backward) a causal
    square took 1.03 ms and a full one 1.01 ms. There a query block the mask cuts runs as one
    masked tile over its keys rather than up to three: a rank's tiles at sequence 4096, CP=4
    (best of 15, one thread) took 57 ms instead of 65 for a 128-token window (18 calls instead
    of 48), 36 instead of 39 for packed documents of 256, 35 instead of 38 for chunks of 256."""
    return device_type == "cpu"


def _keys(tile, offset: int) -> slice:
    # a chunk that arrived trimmed to its shipped rows: tile slices count from the whole chunk
    return tile.k if not offset else slice(tile.k.start - offset, tile.k.stop - offset)


def _flip(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    # a reversed tile's rows and keys in reverse order: its upper triangle becomes causal's lower one
    return x.flip(dim)


def _same(x: torch.Tensor, dim: int = 2) -> torch.Tensor:
    return x


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
    for tile in tiles:
        rows = _keys(tile, offset)
        flip = _flip if tile.reverse else _same
        block_out, block_lse = call_op(FORWARD, q.device.type, flip(q[:, :, tile.q]), flip(k[:, :, rows]),
                                       flip(v[:, :, rows]), scale, tile.mask, tile.causal)
        merge_into(out[:, :, tile.q], lse[:, :, tile.q], flip(block_out), flip(block_lse, -1))


def tile_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: list, out: torch.Tensor,
               lse: torch.Tensor, grad_out: torch.Tensor, grad_q: torch.Tensor, offset: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One source's tiles' gradients: adds their dQ into ``grad_q`` and returns that source's
    dK and dV (K/V heads, the shape of ``k``)."""
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for tile in tiles:
        rows = _keys(tile, offset)
        flip = _flip if tile.reverse else _same
        dq, dk, dv = call_op(BACKWARD, q.device.type, flip(q[:, :, tile.q]), flip(k[:, :, rows]),
                             flip(v[:, :, rows]), scale, tile.mask, flip(out[:, :, tile.q]),
                             flip(lse[:, :, tile.q], -1), flip(grad_out[:, :, tile.q]), tile.causal)
        dq, dk, dv = flip(dq), flip(dk), flip(dv)
        grad_q[:, :, tile.q] += dq
        grad_k[:, :, rows] += dk
        grad_v[:, :, rows] += dv
    return grad_k, grad_v
