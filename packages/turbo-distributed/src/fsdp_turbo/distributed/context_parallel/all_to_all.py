"""Ulysses' two all-to-alls, differentiable: sequence-sharded <-> head-sharded; and the
plain all-gather of every rank's chunk that the KV all-gather and the sparse layers share.

Layouts are HF's attention layouts: ``[batch, heads, seq, head_dim]`` in, ``[batch, seq,
heads, head_dim]`` out of the core attention. Rank ``c`` holds sequence chunk ``c``
before and head group ``c`` after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol


def _exchange(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``chunks [cp, ...]``: chunk ``j`` goes to rank ``j``; returns ``[cp, ...]`` by source."""
    size = chunks.shape[0]
    rows = chunks.shape[1] if chunks.dim() > 1 else 1
    flat = chunks.reshape(size * rows, -1).contiguous()
    out = funcol.all_to_all_single_autograd(flat, [rows] * size, [rows] * size, group)
    return funcol.wait_tensor(out).reshape(chunks.shape)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[B, H, S/cp, D]`` (all heads, my sequence chunk) -> ``[B, H/cp, S, D]``."""
    batch, heads, seq, dim = x.shape
    chunks = x.reshape(batch, cp, heads // cp, seq, dim).transpose(0, 1)  # [cp, B, H/cp, S/cp, D]
    received = _exchange(chunks, group)  # [cp (sequence chunk), B, H/cp, S/cp, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * seq, dim)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[B, S, H/cp, D]`` (my heads, the whole sequence) -> ``[B, S/cp, H, D]``."""
    batch, seq, heads, dim = x.shape
    chunks = x.reshape(batch, cp, seq // cp, heads, dim).transpose(0, 1)  # [cp, B, S/cp, H/cp, D]
    received = _exchange(chunks, group)  # [cp (head group), B, S/cp, H/cp, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seq // cp, cp * heads, dim)


def sequence_to_channels(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """``[B, S/cp, cp, F]`` (my sequence chunk; along dim 2 what each rank gets) ->
    ``[B, S, F]`` (what I got from every rank, in sequence order)."""
    batch, seq, _, features = x.shape
    received = _exchange(x.permute(2, 0, 1, 3), group)  # [cp (sequence chunk), B, S/cp, F]
    return received.permute(1, 0, 2, 3).reshape(batch, cp * seq, features)


def gather_chunks(local: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``local`` (all the same shape), in rank order (no gradient)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts
