"""Whole tensors out of a sharded model, one at a time, for the rank that writes them
(``save_pretrained`` of a model, a merged model or PEFT adapters)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_turbo.checkpoint.stored_forms import StoredForm
from fsdp_turbo.core.model_inspect import is_dtensor


def world() -> tuple[int, int]:
    """(world size, rank); (1, 0) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def holders(keys: list[str], local: dict[str, torch.Tensor]) -> dict[str, int]:
    """For tensors some ranks do not hold (a list of experts under expert parallel): the
    lowest rank that holds each. A collective when distributed."""
    size, _ = world()
    absent = [k for k in keys if k not in local]
    if size == 1:
        return {}
    everyone: list[list[str]] = [[] for _ in range(size)]
    dist.all_gather_object(everyone, absent)
    lacking = {k for ranks_absent in everyone for k in ranks_absent}
    return {k: min(r for r in range(size) if k not in everyone[r]) for k in keys if k in lacking}


def whole(value: torch.Tensor | None, holder: int | None, like: torch.Tensor, device: torch.device,
          form: StoredForm | None = None) -> torch.Tensor:
    """The full tensor on the host of every rank (a collective when the model is sharded). A
    tensor only some ranks hold is gathered among them first, then broadcast from the lowest.
    A stored-form parameter (``form``: QLoRA-MX bytes) is gathered as stored, then decoded to
    the values ``like`` describes."""
    full = None
    if value is not None:
        full = value.full_tensor() if is_dtensor(value) else value
        full = full.detach()
        if form is not None:
            full = form.decode(full, like.dtype)
    if holder is not None:
        # Only the source's own tensor goes in: the others receive into new memory.
        sending = dist.get_rank() == holder
        buffer = full.to(device) if sending else torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(buffer, src=holder)
        return buffer.cpu()
    return full.cpu()
