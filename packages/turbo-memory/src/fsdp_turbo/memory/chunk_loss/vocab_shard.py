"""Local views of a (possibly tensor-parallel) loss head: which vocab rows this rank holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


@dataclass(frozen=True)
class LocalHead:
    weight: torch.Tensor
    bias: torch.Tensor | None
    vocab_group: dist.ProcessGroup | None
    vocab_start: int
    mesh: object | None  # the DeviceMesh, when the head is a DTensor


def _vocab_dim(weight: DTensor) -> int | None:
    dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for i, p in enumerate(weight.placements) if i not in dims and not isinstance(p, Replicate)]
    if len(dims) > 1 or others:
        raise ValueError(f"the loss head's weight has placements {weight.placements}; chunked loss supports "
                         "a vocab (row) shard on one mesh dimension, replicated elsewhere")
    return dims[0] if dims else None


def local_head(weight: torch.Tensor, bias: torch.Tensor | None) -> LocalHead:
    """The head's local weight and bias, with the vocab group and offset when sharded on vocab."""
    if not isinstance(weight, DTensor):
        return LocalHead(weight, bias, None, 0, None)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dim = _vocab_dim(weight)
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    if dim is None:
        return LocalHead(weight.to_local(), local_bias, None, 0, weight.device_mesh)
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return LocalHead(weight.to_local(), local_bias, weight.device_mesh.get_group(dim), int(offset[0]),
                     weight.device_mesh)


def local_hidden(hidden: torch.Tensor, head: LocalHead) -> torch.Tensor:
    """The full hidden states on this rank. With a vocab-sharded head each rank's gradient
    is a partial sum, so the DTensor turns it into a reduction on the way back."""
    if not isinstance(hidden, DTensor):
        return hidden
    replicated = [Replicate()] * hidden.device_mesh.ndim
    if list(hidden.placements) != replicated:
        hidden = hidden.redistribute(hidden.device_mesh, replicated)
    if head.vocab_group is None:
        return hidden.to_local()
    return hidden.to_local(grad_placements=[Partial()] * hidden.device_mesh.ndim)


def empty_logits(hidden: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """What the head returns instead of logits: a [..., 0] tensor (a DTensor if the input was),
    so any logits post-processing in the model stays valid and costs nothing."""
    empty = local.new_empty((*local.shape[:-1], 0)).detach()
    if isinstance(hidden, DTensor):
        mesh = hidden.device_mesh
        return DTensor.from_local(empty, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return empty
