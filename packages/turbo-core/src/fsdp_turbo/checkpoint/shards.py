"""This rank's part of each model tensor, as a box of the global tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_turbo.core.model_inspect import is_dtensor, local_tensor
from fsdp_turbo.core.stage_part import stage_parts


@dataclass(frozen=True)
class LocalBox:
    """``tensor`` is the global tensor's box ``start:start + size`` (all of it when not a DTensor)."""

    tensor: torch.Tensor
    start: tuple[int, ...]
    size: tuple[int, ...]


def local_box(value: torch.Tensor) -> LocalBox:
    if not is_dtensor(value):
        return LocalBox(value.detach(), (0,) * value.dim(), tuple(value.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, start = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    local = local_tensor(value, differentiable=False)
    if tuple(local.shape) != tuple(size):
        raise RuntimeError(f"a DTensor's local shard is {tuple(local.shape)}, but its placements say {tuple(size)}")
    return LocalBox(local, tuple(start), tuple(size))


def local_boxes(value: torch.Tensor) -> list[LocalBox]:
    """This rank's part of ``value`` as boxes of the global tensor: one, but for a DTensor with a lone
    ``_StridedShard`` (LoRA experts' ``lora_B`` under expert parallel), whose shard is ``split_factor``
    boxes, each a view of the shard (see ``checkpoint.strided``)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from fsdp_turbo.checkpoint.strided import lone_strided, plain_view

    if not lone_strided(value):
        return [local_box(value)]
    (strided,) = [p for p in value.placements if isinstance(p, _StridedShard)]
    dim = strided.dim
    view = local_box(plain_view(value))  # dims: ..., split_factor, columns per block, ...
    block = value.shape[dim] // strided.split_factor
    boxes = []
    for j in range(view.size[dim]):
        start = (*view.start[:dim], j * block + view.start[dim + 1], *view.start[dim + 2:])
        size = (*view.size[:dim], view.size[dim + 1], *view.size[dim + 2:])
        boxes.append(LocalBox(view.tensor.select(dim, j), start, size))
    return boxes


def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer ``model`` holds on this rank, persistent or not, by qualified
    name. Of a pipelined model, its first stage's: each stage holds its own copy of what every
    stage has (the rotary frequencies), under the same name, so the stages are filled one by
    one (:func:`stage_parts`), and read together through :func:`held_tensors`."""
    found = dict(model.named_parameters(remove_duplicate=False))
    found.update(model.named_buffers(remove_duplicate=False))
    return found


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``local_tensors`` over every pipeline stage this rank holds (a name several stages share
    names copies of the same values: any one serves to read them)."""
    return {name: tensor for part in stage_parts(model) for name, tensor in local_tensors(part).items()}


def overlap(a_start: tuple[int, ...], a_size: tuple[int, ...], b_start: tuple[int, ...], b_size: tuple[int, ...]
            ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes (start, size), or None when they do not meet."""
    start = tuple(max(a, b) for a, b in zip(a_start, b_start, strict=True))
    end = tuple(min(a + n, b + m) for a, n, b, m in zip(a_start, a_size, b_start, b_size, strict=True))
    if any(e <= s for s, e in zip(start, end, strict=True)):
        return None
    return start, tuple(e - s for s, e in zip(start, end, strict=True))
