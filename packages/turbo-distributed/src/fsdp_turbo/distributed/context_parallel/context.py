"""What one forward of a context-parallel model needs to know: set by the input hook,
read by the attention wrapper."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ForwardContext:
    seq_len: int  # the padded full sequence length, a multiple of cp
    padding_mask: torch.Tensor | None = None  # [B, seq_len] bool, True = a real token, or None
    documents: torch.Tensor | None = None  # [B, seq_len] packed-document index of each token, or None
    attention_calls: int = 0  # how many attention layers ran through the Ulysses wrapper
    # ring: the global positions (into the padded sequence) of each CP rank's tokens
    rank_positions: list[torch.Tensor] | None = None
    ring_masks: list[torch.Tensor | None] | None = None  # built by the first attention layer, reused


@dataclass
class CPState:
    """One model's context-parallel group and its current forward."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    current: ForwardContext | None = field(default=None)
    attention_layers: int = 0  # the wrapper must run this many times a forward (0: not checked)
    mode: str = "ulysses"  # or "ring"
    load_balance: bool = True  # ring: zig-zag chunks
    proven: bool = False  # the first forward showed that it does
