"""DTensors with a ``_StridedShard`` placement, seen by ``torch.distributed.checkpoint`` as plain shards.

LoRA on MoE experts under expert parallel keeps each rank's ``lora_B`` columns as ``r`` strided
blocks (``_StridedShard(1, split_factor=r)``: PEFT's ``[out, r * E]`` is expert-minor), and so
does its AdamW state. DCP refuses to save such a tensor (its planner sees "overlapping
chunks"). The same data is a plain ``Shard`` of a view with the strided dim split in two:
``[out, r * E]`` as ``[out, r, E]``, sharded on ``E``. ``for_dcp`` swaps every such DTensor
of a state dict for that view. The view shares the shard's storage, so DCP loads in place into
the model's and optimizer's own tensors; ``from_dcp`` then takes the loaded state back to the
original form (DCP also replaces non-tensor values, such as the optimizer's step and learning
rates, in the dicts it is given). A checkpoint written this way reshards to another
expert-parallel size, as any DCP checkpoint does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def for_dcp(state: Any) -> Any:
    """``state`` (nested dicts and lists, as ``get_state_dict`` returns) with each strided DTensor
    replaced by its plain-sharded view; everything else is kept as it is (the same objects)."""
    if isinstance(state, dict):
        return {key: for_dcp(value) for key, value in state.items()}
    if isinstance(state, list):
        return [for_dcp(value) for value in state]
    if lone_strided(state):
        return plain_view(state)
    return state


def from_dcp(loaded: Any, original: Any) -> Any:
    """``loaded`` (what DCP filled, from ``for_dcp(original)``) with each view put back as its
    original tensor, which the view's load has already written into."""
    if isinstance(loaded, dict):
        return {key: from_dcp(value, original.get(key)) if isinstance(original, dict) else value
                for key, value in loaded.items()}
    if isinstance(loaded, list):
        return [from_dcp(value, original[i]) if isinstance(original, list) and i < len(original) else value
                for i, value in enumerate(loaded)]
    if lone_strided(original):
        return original
    return loaded


def lone_strided(value: Any) -> bool:
    """A DTensor whose one ``_StridedShard`` dim no other placement shards. (FSDP over a sharded dim,
    e.g. ``(_StridedShard(0), Shard(0))``, is a nesting DCP computes right and is left alone.)"""
    if not isinstance(value, DTensor):
        return False
    strided = [p for p in value.placements if isinstance(p, _StridedShard)]
    return len(strided) == 1 and not any(p.is_shard() and p.dim == strided[0].dim for p in value.placements
                                         if not isinstance(p, _StridedShard))


def plain_view(tensor: DTensor) -> DTensor:
    (strided,) = [p for p in tensor.placements if isinstance(p, _StridedShard)]
    dim, factor = strided.dim, strided.split_factor
    placements = [Shard(dim + 1) if isinstance(p, _StridedShard)
                  else Shard(p.dim + 1) if p.is_shard() and p.dim > dim else p for p in tensor.placements]
    local = tensor.to_local()
    local_shape = (*local.shape[:dim], factor, local.shape[dim] // factor, *local.shape[dim + 1:])
    shape = (*tensor.shape[:dim], factor, tensor.shape[dim] // factor, *tensor.shape[dim + 1:])
    view = local.view(local_shape)  # shares the shard's storage: DCP loads into the real tensor
    return DTensor.from_local(view, tensor.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
