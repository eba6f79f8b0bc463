"""``save_pretrained``: a (sharded) model written as transformers' own ``save_pretrained``
writes it, without any rank holding the whole model."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.checkpoint.atomic import move_into_place
from fsdp_turbo.checkpoint.layout import checkpoint_layout
from fsdp_turbo.checkpoint.materialize import target_device
from fsdp_turbo.checkpoint.shards import local_tensors
from fsdp_turbo.core import hf
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.blueprint import blueprint as blueprint_of
from fsdp_turbo.core.blueprint import has_meta_tensors
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.model_inspect import is_dtensor

INDEX = "model.safetensors.index.json"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _holders(keys: list[str], local: dict[str, torch.Tensor]) -> dict[str, int]:
    """For tensors some ranks do not hold (a list of experts under expert parallel): the
    lowest rank that holds each."""
    world, _ = _world()
    absent = [k for k in keys if k not in local]
    if world == 1:
        return {}
    everyone: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, absent)
    lacking = {k for ranks_absent in everyone for k in ranks_absent}
    return {k: min(r for r in range(world) if k not in everyone[r]) for k in keys if k in lacking}


def _whole(key: str, value: torch.Tensor | None, holder: int | None, like: torch.Tensor,
           device: torch.device) -> torch.Tensor:
    """The full tensor on every rank (a collective when the model is sharded). A tensor only
    some ranks hold is gathered among them first, then broadcast from the lowest."""
    whole = None
    if value is not None:
        whole = value.full_tensor() if is_dtensor(value) else value
        whole = whole.detach()
    if holder is not None:
        # Only the source's own tensor goes in: the others receive into new memory.
        sending = dist.get_rank() == holder
        buffer = whole.to(device) if sending else torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(buffer, src=holder)
        return buffer.cpu()
    return whole.cpu()


def _config(blueprint: nn.Module, dtype: torch.dtype):
    # The config as the user built the model: features may have changed the live one
    # (context parallel registers its own attention name).
    config = copy.deepcopy(blueprint.config)
    config.dtype = dtype
    config.architectures = [type(blueprint).__name__]
    return config


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write ``model`` to ``path`` as transformers' ``save_pretrained`` would: ``config.json``
    (and ``generation_config.json``), the checkpoint's own tensor names and shapes (one
    tensor per MoE expert), in safetensors files of at most ``max_shard_size`` with
    ``model.safetensors.index.json`` when there are several. ``dtype`` casts every tensor
    (default: as the model holds them). A collective: call it on every rank.

    Files are written in turn, each by one rank (file ``i`` by rank ``i % world``). For each
    file, every rank gathers the model tensors it is made of, one at a time, and the writer
    keeps that file's checkpoint tensors. So no rank holds more than its own shards plus one
    file. Everything is written to ``<path>.partial`` and renamed into place when complete.
    """
    if has_meta_tensors(model):
        raise CheckpointError("model", type(model).__name__, "load_pretrained or init_weights it first",
                              reason="it is still on the meta device")
    _, rank = _world()
    blueprint = blueprint_of(model)
    layout = checkpoint_layout(blueprint)
    local = local_tensors(model)
    device = target_device(model)
    meta = hf.saved_state(blueprint, blueprint.state_dict(keep_vars=True))
    saved_dtype = dtype or next(iter(meta.values())).dtype
    # Files are cut along the model's own tensors, so each one is gathered for one file only;
    # each file then holds those tensors in the checkpoint layout (transformers does the
    # same when it saves offloaded weights).
    sizes = {k: torch.empty(t.shape, dtype=dtype or t.dtype, device="meta") for k, t in meta.items()}
    split = hf.split_into_files(sizes, max_shard_size)
    holders = _holders(list(layout.pieces), local)
    target, partial = Path(path), Path(f"{os.fspath(path)}.partial")
    with every_rank_or_none("save_pretrained", device):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
    _write_files(blueprint, split, holders, local, meta, dtype, partial, device)
    with every_rank_or_none("save_pretrained", device):
        if rank == 0:
            _config(blueprint, saved_dtype).save_pretrained(partial)
            if blueprint.can_generate():
                blueprint.generation_config.save_pretrained(partial)
            if split.is_sharded:
                weight_map = {piece.key: filename for filename, keys in split.filename_to_tensors.items()
                              for key in keys for piece in layout.pieces[key]}
                total = sum(t.numel() for t in meta.values())
                index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": weight_map}
                (partial / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            move_into_place(partial, target)
    return target


def _write_files(blueprint, split, holders, local, meta, dtype, partial: Path, device) -> None:
    from safetensors.torch import save_file

    world, rank = _world()
    for index, (filename, keys) in enumerate(split.filename_to_tensors.items()):
        writer = index % world
        tensors: dict[str, torch.Tensor] = {}
        for model_key in keys:
            whole = _whole(model_key, local.get(model_key), holders.get(model_key), meta[model_key], device)
            converted = hf.to_checkpoint_layout(blueprint, {model_key: whole})
            del whole
            if rank == writer:
                tensors.update({k: (v.to(dtype) if dtype is not None else v).contiguous()
                                for k, v in converted.items()})
        with every_rank_or_none("save_pretrained", device):
            if rank == writer:
                save_file(dict(sorted(tensors.items())), str(partial / filename), metadata={"format": "pt"})
        del tensors
