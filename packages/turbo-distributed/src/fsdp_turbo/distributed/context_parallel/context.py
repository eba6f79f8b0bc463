"""What one forward of a context-parallel model needs to know: set by the input hook,
read by the attention wrapper."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LayerSpec:
    """What the context-parallel attention must know of one attention module, from the model
    facts: its window or chunk (masked from global positions) and the per-head tensors its
    core attention reads from it (cut to each Ulysses rank's heads)."""

    name: str
    index: int | None = None  # its layer (block) index
    window: int | None = None
    chunk: int | None = None
    head_parameters: tuple[str, ...] = ()
    # the family's query scale by row index (Llama 4's temperature), if the module's queries get one
    query_scale: Callable[..., Any] | None = None


@dataclass
class ForwardContext:
    seq_len: int  # the padded full sequence length, a multiple of cp
    padding_mask: torch.Tensor | None = None  # [B, seq_len] bool, True = a real token, or None
    documents: torch.Tensor | None = None  # [B, seq_len] packed-document index of each token, or None
    attention_calls: int = 0  # how many attention layers ran through the Ulysses wrapper
    linear_calls: int = 0  # how many linear-attention layers ran through theirs
    # ring / hybrid: the global positions (in the padded sequence) of each ring member's tokens
    ring_positions: list[torch.Tensor] | None = None
    # per (window, chunk) (None, None: full causal): per source rank its Tiles, the ring's steps and
    # the rows of each chunk it ships; built by the first layer of each, reused
    ring_tiles: dict = field(default_factory=dict)
    positions: torch.Tensor | None = None  # [B, seq_len] the position values (position_ids, padding continuing them)
    my_positions: torch.Tensor | None = None  # [seq_len / cp] this rank's tokens' indices in the padded rows
    # every CP rank's tokens gathered in rank order, indexed by this: the sequence's order (None: already it)
    sequence_order: torch.Tensor | None = None
    _chunks: dict = field(default_factory=dict)
    _documents: dict = field(default_factory=dict)

    def chunk_ids(self, chunk: int) -> torch.Tensor:
        """Each token's block of ``chunk`` positions, ``[B or 1, seq_len]``, as transformers' chunked
        mask counts them: in packed rows by the token's own position (blocks restart with each
        document), else by its index in the row less the row's left padding."""
        if chunk not in self._chunks:
            if self.documents is not None and self.positions is not None:
                ids = self.positions // chunk
            else:
                index = torch.arange(self.seq_len)
                if self.padding_mask is not None:
                    lead = (~self.padding_mask).long().cumprod(dim=1).sum(dim=1, keepdim=True)  # left padding per row
                    ids = (index[None] - lead.to(index.device)) // chunk
                else:
                    ids = (index // chunk)[None]
            self._chunks[chunk] = ids
        return self._chunks[chunk]

    def layout_key(self) -> tuple:
        """What a layer's block map depends on besides its mask kind, by content: the sequence
        length, every ring member's positions, the documents (and the position values, by which
        packed rows count their chunks) and the padding. Steps of one layout share their maps."""
        def content(tensor: torch.Tensor | None) -> tuple | None:
            return None if tensor is None else (tuple(tensor.shape), tensor.detach().cpu().numpy().tobytes())

        return (self.seq_len, tuple(content(p) for p in self.ring_positions or ()), content(self.documents),
                content(self.positions if self.documents is not None else None), content(self.padding_mask))

    def document_breaks(self) -> set[int]:
        """The positions where a packed document begins in some row (the block map cuts its
        query blocks there)."""
        if "breaks" not in self._documents:
            change = (self.documents[:, 1:] != self.documents[:, :-1]).any(0)
            self._documents["breaks"] = set(change.nonzero().flatten().add(1).tolist())
        return self._documents["breaks"]

    def document_starts(self) -> torch.Tensor:
        """``[seq_len]``: for each position, the first position of its document in any row (the
        earliest key a query there may see)."""
        if "starts" not in self._documents:
            index = torch.arange(self.documents.shape[1])
            first = torch.ones_like(self.documents, dtype=torch.bool)
            first[:, 1:] = self.documents[:, 1:] != self.documents[:, :-1]
            starts = torch.where(first, index, 0).cummax(dim=1).values
            self._documents["starts"] = starts.min(0).values
        return self._documents["starts"]


@dataclass
class CPState:
    """One model's context-parallel group and its current forward."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    current: ForwardContext | None = field(default=None)
    attention_layers: int = 0  # the wrapper must run this many times a forward (0: not checked)
    layers: dict = field(default_factory=dict)  # attention module -> its LayerSpec (window, chunk, per-head tensors)
    linear_layers: int = 0  # the linear-attention forward must run this many times a forward
    mode: str = "ulysses"  # "ring", "hybrid" or "kv_allgather"
    block_size: int = 64  # ring / KV all-gather: the query rows of one block of the block map
    load_balance: bool = True  # ring / hybrid: zig-zag chunks over the ring
    # ring / KV all-gather: the block maps of the last few layouts (ForwardContext.layout_key), the
    # newest last: a training run's steps mostly repeat one layout (one sequence length, no
    # documents), and building a map costs Python work and, on a device, a sync per tile
    block_maps: OrderedDict = field(default_factory=OrderedDict)
    # The two halves of CP rank ``ring_rank * ulysses_size + ulysses_rank``: the Ulysses
    # all-to-all runs inside a group of ulysses_size consecutive CP ranks, the ring (or the KV
    # all-gather) across them. Pure Ulysses: ulysses = the whole CP group; pure ring or KV
    # all-gather: ring = the whole CP group.
    ulysses_group: dist.ProcessGroup | None = None
    ulysses_size: int = 0
    ring_group: dist.ProcessGroup | None = None
    ring_size: int = 1
    ring_rank: int = 0

    def __post_init__(self) -> None:
        if self.mode == "ulysses" and not self.ulysses_size:
            self.ulysses_group, self.ulysses_size = self.group, self.size
        if self.mode in ("ring", "kv_allgather") and self.ring_group is None:
            self.ring_group, self.ring_size, self.ring_rank, self.ulysses_size = self.group, self.size, self.rank, 1

    proven: bool = False  # the first forward ran the wrapper in every attention layer

    def spec(self, module):
        """The plan's ``LayerSpec`` of an attention module, or of the module a heads view stands
        for (an empty one for a module the model facts do not list: a non-HF core attention,
        whose call says what it needs)."""
        return self.layers.get(getattr(module, "_module", module)) or LayerSpec("")

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_size
