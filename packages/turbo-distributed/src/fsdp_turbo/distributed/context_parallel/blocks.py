"""The block map of a sequence-sharded attention: which of this rank's queries see which of
another rank's keys, as ``Tile``s the kernels compute (ring and KV all-gather alike).

A rank's tokens are runs of consecutive global positions (contiguous chunks: one run;
zig-zag: two). For each pair of runs (this rank's queries, a source's keys):

- a pair nothing sees is left out (a later block under causal, out of a window's reach,
  an earlier chunk of a chunked layer);
- without documents or padding, a pair everything sees, or a plain causal square, is one
  tile with no mask, decided from the runs' ends alone (no ``[S, S]`` mask is built);
- anything else the mask cuts is split into query blocks of ``block`` rows (and at every
  chunk and document boundary), and each block computes only the keys its rows can see, in
  up to three tiles: the window's lower edge, the keys every row sees (no mask) and the
  diagonal (causal, or masked). Where the block divides the window, the edge is an upper
  triangle, which a causal kernel computes with both sides reversed; else it is masked. So
  the pairs computed are at most what the mask keeps plus about half a ``block x block``
  square per query block, whatever the mask: a window, chunks, packed documents or causal.

Full tiles side by side (zig-zag's off-diagonal halves, a window's full rows) are joined.
With ``whole_blocks`` (kernels that compute a causal square as dearly as a full one: CPU's), a
query block is one tile over all the keys it sees instead, masked where the mask cuts it.

``shipped_rows`` says which rows of each source's chunk any other rank can see: a contiguous
ring with a window sends only those.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from fsdp_turbo.distributed.context_parallel.ring_math import visible

DEFAULT_BLOCK = 64


@dataclass(frozen=True)
class Tile:
    """A part of one block: this rank's queries ``q`` against the source's keys ``k`` (slices
    of the chunks), with its mask (None: every pair visible)."""

    q: slice
    k: slice
    mask: torch.Tensor | None
    causal: bool = False  # a diagonal square: plain causal, no mask needed
    # with causal: the upper triangle instead (a window's lower edge, ``key >= query`` in the
    # square): causal once both sides are reversed
    reverse: bool = False


ALL = slice(None)


def tiles_of(entry: list[Tile] | torch.Tensor | None) -> list[Tile]:
    """A source's tiles; a bare mask (or None) is one tile over the whole block."""
    if isinstance(entry, list):
        return entry
    if entry is not None and not bool(entry.any()):
        return []
    return [Tile(ALL, ALL, entry)]


def runs(positions: torch.Tensor) -> list[slice]:
    """The runs of consecutive positions (zig-zag chunks: two), as slices of the chunk."""
    breaks = (torch.diff(positions) != 1).nonzero().flatten().add(1).tolist()
    edges = [0, *breaks, positions.numel()]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def ends(positions: torch.Tensor, run: slice) -> tuple[int, int]:
    return int(positions[run.start]), int(positions[run.stop - 1])


def earliest(q_first: int, window: int | None, chunk: int | None, starts: torch.Tensor | None = None) -> int:
    """The first key position any query from ``q_first`` on may see: each bound grows with the
    query, so the run's first query's is the run's. ``window``: a sliding window's; ``chunk``: a
    chunked layer's blocks where they follow the positions; ``starts``: each position's document
    start (``ForwardContext.document_starts``)."""
    first = 0
    if window is not None:
        first = max(first, q_first - window + 1)
    if chunk is not None:
        first = max(first, q_first // chunk * chunk)
    if starts is not None:
        first = max(first, int(starts[q_first]))
    return first


def unseen(q_ends: tuple[int, int], k_ends: tuple[int, int], window: int | None, chunk: int | None = None,
           starts: torch.Tensor | None = None) -> bool:
    """No query of the run sees any key of the other: every key comes later, or lies before
    what the run's first query may see (``earliest``)."""
    (q_first, q_last), (k_first, k_last) = q_ends, k_ends
    return k_first > q_last or k_last < earliest(q_first, window, chunk, starts)


def _lower(part: torch.Tensor) -> torch.Tensor:
    square = torch.ones(part.shape[-2], part.shape[-1], dtype=torch.bool, device=part.device).tril()
    return square.expand_as(part)


def _upper(part: torch.Tensor) -> torch.Tensor:
    square = torch.ones(part.shape[-2], part.shape[-1], dtype=torch.bool, device=part.device).triu()
    return square.expand_as(part)


def triangle(tile: Tile, part: torch.Tensor) -> torch.Tensor:
    """What a causal tile computes, as a mask of ``part``'s shape."""
    return _upper(part) if tile.reverse else _lower(part)


def _plain_tile(q_ends: tuple[int, int], k_ends: tuple[int, int], q_run: slice, k_run: slice,
                window: int | None, chunk: int | None) -> Tile | None:
    """Without documents or padding: the mask-free tile the runs make (every pair visible, or
    a causal square), or None when the mask cuts it."""
    (q_first, q_last), (k_first, k_last) = q_ends, k_ends
    inside = window is None or q_last - k_first < window  # no pair of the runs is out of the window
    one_block = chunk is None or k_first // chunk == q_last // chunk  # every pair in one block
    if inside and one_block:
        if k_last <= q_first:
            return Tile(q_run, k_run, None)
        if q_ends == k_ends:
            return Tile(q_run, k_run, None, causal=True)
    return None


def _masked_tile(q_run: slice, k_run: slice, mine: torch.Tensor, theirs: torch.Tensor, context,
                 device: torch.device, window: int | None, chunk: int | None) -> Tile | None:
    """The tile from its own mask (small: one query block against the keys it may see)."""
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
    square = allowed.shape[-1] == allowed.shape[-2]
    if ends(mine, q_run) == ends(theirs, k_run) and torch.equal(allowed, _lower(allowed)):
        return Tile(q_run, k_run, None, causal=True)
    if square and torch.equal(allowed, _upper(allowed)):  # a window's lower edge, block rows inside the window
        return Tile(q_run, k_run, None, causal=True, reverse=True)
    return Tile(q_run, k_run, allowed.contiguous())


def _query_blocks(run: slice, positions: torch.Tensor, block: int, breaks: set[int]) -> list[slice]:
    """The run cut every ``block`` rows and before every position in ``breaks`` (a chunk's or
    document's first), so no query block straddles one."""
    first = int(positions[run.start])
    cuts = {run.start + offset for offset in range(0, run.stop - run.start, block)}
    cuts |= {run.start + p - first for p in breaks if first < p <= int(positions[run.stop - 1])}
    edges = [*sorted(cuts), run.stop]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def _block_tiles(rows: slice, k_run: slice, mine: torch.Tensor, theirs: torch.Tensor, context, device: torch.device,
                 window: int | None, chunk: int | None, plain: bool, whole: bool) -> list[Tile]:
    """One query block against the keys of ``k_run`` it can see: the window's lower edge
    (masked), the keys every row sees (no mask), the diagonal (causal or masked). ``whole``:
    one tile over all of them instead (masked where the mask cuts it)."""
    r_first, r_last = ends(mine, rows)
    starts = context.document_starts() if context.documents is not None else None
    low = earliest(r_first, window, chunk if plain else None, starts)  # the first key position any row may see
    if whole:
        spans = [(low, r_last + 1)]
    else:
        # every row sees the keys [every, r_first); the window's edge [low, every) is the square whose
        # last key only the last row's window just reaches: an upper triangle when nothing clips it
        every = min(max(low, r_last - window + 2), r_first) if window is not None else low
        spans = [(low, every), (every, r_first), (r_first, r_last + 1)]
    k_first, k_last = ends(theirs, k_run)
    tiles = []
    for a, b in spans:
        a, b = max(a, k_first), min(b, k_last + 1)
        if a >= b:
            continue
        keys = slice(k_run.start + a - k_first, k_run.start + b - k_first)
        tile = _plain_tile((r_first, r_last), (a, b - 1), rows, keys, window, chunk) if plain else None
        tile = tile or _masked_tile(rows, keys, mine, theirs, context, device, window, chunk)
        if tile is not None:
            tiles.append(tile)
    return tiles


def _pair_tiles(q_run: slice, k_run: slice, mine: torch.Tensor, theirs: torch.Tensor, context, device: torch.device,
                window: int | None, chunk: int | None, block: int, whole: bool) -> list[Tile]:
    q_ends, k_ends = ends(mine, q_run), ends(theirs, k_run)
    plain = context.documents is None and context.padding_mask is None
    starts = context.document_starts() if context.documents is not None else None
    if unseen(q_ends, k_ends, window, chunk if plain else None, starts):
        return []
    if plain and (entire := _plain_tile(q_ends, k_ends, q_run, k_run, window, chunk)) is not None:
        return [entire]
    breaks = set()
    if chunk is not None and plain:
        breaks |= set(range(0, q_ends[1] + 1, chunk))
    if context.documents is not None:
        breaks |= context.document_breaks()
    return [tile for rows in _query_blocks(q_run, mine, block, breaks)
            for tile in _block_tiles(rows, k_run, mine, theirs, context, device, window, chunk, plain, whole)]


def _join(tiles: list[Tile], along: str) -> list[Tile]:
    """Full tiles adjacent ``along`` "k" (one query slice, keys side by side) or "q" (one key
    slice, queries one under the other) as one: the same work in fewer, larger kernel calls."""
    other = "q" if along == "k" else "k"
    joined: list[Tile] = [t for t in tiles if t.mask is not None or t.causal]
    full = sorted((t for t in tiles if t.mask is None and not t.causal),
                  key=lambda t: (getattr(t, other).start, getattr(t, other).stop, getattr(t, along).start))
    for tile in full:
        last = joined[-1] if joined else None
        if (last is not None and last.mask is None and not last.causal and getattr(last, other) == getattr(tile, other)
                and getattr(last, along).stop == getattr(tile, along).start):
            span = slice(getattr(last, along).start, getattr(tile, along).stop)
            joined[-1] = Tile(span, last.k, None) if along == "q" else Tile(last.q, span, None)
        else:
            joined.append(tile)
    return joined


def source_tiles(context, mine: torch.Tensor, theirs: torch.Tensor, device: torch.device, window: int | None = None,
                 chunk: int | None = None, block: int = DEFAULT_BLOCK, whole_blocks: bool = False) -> list[Tile]:
    """This rank's queries (positions ``mine``) against one source's keys (``theirs``);
    ``whole_blocks``: see ``ring_tiles``."""
    tiles = [tile for q_run in runs(mine) for k_run in runs(theirs)
             for tile in _pair_tiles(q_run, k_run, mine, theirs, context, device, window, chunk, block, whole_blocks)]
    return _join(_join(tiles, "k"), "q")


def ring_tiles(context, rank: int, device: torch.device, window: int | None = None, chunk: int | None = None,
               block: int = DEFAULT_BLOCK, whole_blocks: bool = False) -> list[list[Tile]]:
    """This rank's queries against every rank's keys: causal by global position, within each
    packed document, the sliding window and the chunk, never onto padding. ``whole_blocks``:
    a query block the mask cuts is one tile over every key it sees (masked), not up to three
    (for kernels that compute a causal square as dearly as a full one)."""
    positions = [p.to(device) for p in context.ring_positions]
    return [source_tiles(context, positions[rank], theirs, device, window, chunk, block, whole_blocks)
            for theirs in positions]


def ring_steps(positions: list[torch.Tensor], window: int | None, chunk: int | None = None,
               starts: torch.Tensor | None = None) -> int:
    """How many ring steps a layer needs (the same on every rank: it reads every member's
    positions): one past the last step at which some rank's queries can see the chunk it
    then holds (by position, window, blocks and documents; padding only hides more, so the
    caller passes ``chunk`` only where blocks follow the positions). Causal attention needs
    every step; a window, blocks or documents shorter than the chunks, with contiguous
    chunks, only the previous rank's: the K/V stop travelling there, and so do their
    gradients."""
    if window is None and chunk is None and starts is None:
        return len(positions)
    member_runs = [[ends(p, run) for run in runs(p)] for p in positions]
    size = len(positions)

    def seen(step: int) -> bool:
        return any(not unseen(q, k, window, chunk, starts) for rank in range(size)
                   for q in member_runs[rank] for k in member_runs[(rank - step) % size])

    return 1 + max(step for step in range(size) if seen(step))


def shipped_rows(positions: list[torch.Tensor], window: int | None, chunk: int | None = None,
                 starts: torch.Tensor | None = None) -> list[slice]:
    """For each member, the rows of its chunk some other member's queries can see (one span;
    by position, window, blocks and documents, as ``ring_steps``): what the ring must send of it. Under
    causal attention every row but the last chunk's; a window over contiguous chunks only its
    last ``window - 1`` rows. At least one row, so every member sends something."""
    shipped = []
    for source, theirs in enumerate(positions):
        low, high = theirs.numel(), 0
        for member, mine in enumerate(positions):
            if member == source:
                continue
            for q_run, k_run in itertools.product(runs(mine), runs(theirs)):
                (q_first, q_last), (k_first, k_last) = ends(mine, q_run), ends(theirs, k_run)
                first, last = max(k_first, earliest(q_first, window, chunk, starts)), min(k_last, q_last)
                if first <= last:
                    low = min(low, k_run.start + first - k_first)
                    high = max(high, k_run.start + last - k_first + 1)
        shipped.append(slice(low, high) if high > low else slice(theirs.numel() - 1, theirs.numel()))
    return shipped


def selected_tiles(blocks: list[list[Tile]], indices: torch.Tensor, context, rank: int) -> list[list[Tile]]:
    """The tiles cut to a sparse layer's picks: ``indices [B, s, k]`` the keys (global positions)
    each of this member's queries keeps (DSA's indexer, top-k over the whole sequence). Each
    tile becomes masked by what its mask allowed and the picks; a tile none of whose pairs is
    picked is left out."""
    positions = context.ring_positions
    picked = torch.zeros(*indices.shape[:2], context.seq_len, dtype=torch.bool, device=indices.device)
    picked.scatter_(-1, indices.long(), True)
    picked = picked[:, None]  # [B, 1, s, S]
    out = []
    for source, tiles in enumerate(blocks):
        keys = positions[source].to(indices.device)
        kept = []
        for tile in tiles_of(tiles):
            part = picked[:, :, tile.q][..., keys[tile.k]]
            if tile.mask is not None:
                part = part & tile.mask
            elif tile.causal:
                part = part & triangle(tile, part)
            if bool(part.any()):
                kept.append(Tile(tile.q, tile.k, part.contiguous()))
        out.append(kept)
    return out
