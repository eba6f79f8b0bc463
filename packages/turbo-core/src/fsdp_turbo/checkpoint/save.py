"""``save_pretrained``: a (sharded) model written as transformers' own ``save_pretrained``
writes it, without any rank holding the whole model."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from fsdp_turbo.checkpoint.atomic import move_into_place
from fsdp_turbo.checkpoint.gather import holders as holders_of
from fsdp_turbo.checkpoint.gather import whole, world
from fsdp_turbo.checkpoint.layout import checkpoint_layout
from fsdp_turbo.checkpoint.materialize import target_device
from fsdp_turbo.checkpoint.shards import held_tensors
from fsdp_turbo.checkpoint.stored_forms import stored_forms
from fsdp_turbo.core import hf
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.blueprint import blueprint as blueprint_of
from fsdp_turbo.core.blueprint import has_meta_tensors
from fsdp_turbo.core.errors import CheckpointError, ConfigError
from fsdp_turbo.core.patterns import is_peft_model
from fsdp_turbo.core.stage_part import stage_parts

INDEX = "model.safetensors.index.json"


def _config(blueprint: nn.Module, dtype: torch.dtype):
    # The config as the user built the model: features may have changed the live one
    # (context parallel registers its own attention name).
    config = copy.deepcopy(blueprint.config)
    config.dtype = dtype
    config.architectures = [type(blueprint).__name__]
    return config


class ShardedTensors:
    """The tensors of a (sharded) transformers model by its own keys; ``whole`` is a collective."""

    def __init__(self, model: nn.Module, blueprint: nn.Module, device: torch.device) -> None:
        self.blueprint, self.device = blueprint, device
        self.local, self.forms = held_tensors(model), stored_forms(model)
        self.meta = blueprint.state_dict(keep_vars=True)
        self.holders = holders_of(list(hf.saved_state(blueprint, self.meta)), self.local)

    def whole(self, key: str, writer: int) -> torch.Tensor | None:
        """Tensor ``key`` whole on the host of rank ``writer`` (None elsewhere); every rank calls it."""
        full = whole(self.local.get(key), self.holders.get(key), self.meta[key], self.device, self.forms.get(key))
        return full if world()[1] == writer else None


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB", merge_adapters: bool = False) -> Path:
    """Write ``model`` to ``path`` as transformers' ``save_pretrained`` would: ``config.json``
    (and ``generation_config.json``), the checkpoint's own tensor names and shapes (one
    tensor per MoE expert), in safetensors files of at most ``max_shard_size`` with
    ``model.safetensors.index.json`` when there are several. ``dtype`` casts every tensor
    (default: as the model holds them). A collective: call it on every rank.

    A PEFT model (``get_peft_model``) is written as PEFT's ``PeftModel.save_pretrained``
    writes it: ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's names,
    adapter weights only (another adapter than ``default`` in its own sub-folder). With
    ``merge_adapters=True`` it is written instead as the base model with the active adapters
    merged in (``W + scaling * B @ A``, by PEFT's own merge), which transformers'
    ``from_pretrained`` loads.

    Files are written in turn, each by one rank (file ``i`` by rank ``i % world``). For each
    file, every rank gathers the model tensors it is made of, one at a time, and the writer
    keeps that file's checkpoint tensors. So no rank holds more than its own shards plus one
    file. Everything is written to ``<path>.partial`` and renamed into place when complete.
    """
    if any(has_meta_tensors(part) for part in stage_parts(model)):
        raise CheckpointError("model", type(model).__name__, "load_pretrained or init_weights it first",
                              reason="it is still on the meta device")
    blueprint = blueprint_of(model)
    device = target_device(model)
    if is_peft_model(blueprint):
        from fsdp_turbo.checkpoint import peft_adapters

        if not merge_adapters:
            return peft_adapters.save_adapters(model, blueprint, path, dtype=dtype)
        return _save(peft_adapters.MergedTensors(model, blueprint, device), path, dtype, max_shard_size)
    if merge_adapters:
        raise ConfigError("merge_adapters", merge_adapters, "pass merge_adapters=True only for a PEFT model "
                          "(get_peft_model)", reason=f"{type(blueprint).__name__} has no adapters to merge")
    return _save(ShardedTensors(model, blueprint, device), path, dtype, max_shard_size)


def _save(source, path: str | os.PathLike, dtype: torch.dtype | None, max_shard_size: int | str) -> Path:
    """Write ``source``'s model (``ShardedTensors`` or a merged PEFT model) in transformers' layout."""
    _, rank = world()
    blueprint, device = source.blueprint, source.device
    layout = checkpoint_layout(blueprint)
    meta = hf.saved_state(blueprint, blueprint.state_dict(keep_vars=True))
    saved_dtype = dtype or next(iter(meta.values())).dtype
    # Files are cut along the model's own tensors, so each one is gathered for one file only;
    # each file then holds those tensors in the checkpoint layout (transformers does the
    # same when it saves offloaded weights).
    sizes = {k: torch.empty(t.shape, dtype=dtype or t.dtype, device="meta") for k, t in meta.items()}
    split = hf.split_into_files(sizes, max_shard_size)
    target, partial = Path(path), Path(f"{os.fspath(path)}.partial")
    with every_rank_or_none("save_pretrained", device):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
    _write_files(source, split, dtype, partial)
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


def _write_files(source, split, dtype, partial: Path) -> None:
    from safetensors.torch import save_file

    size, rank = world()
    for index, (filename, keys) in enumerate(split.filename_to_tensors.items()):
        writer = index % size
        tensors: dict[str, torch.Tensor] = {}
        # Sorted, so a module's tensors come together (a merged LoRA layer is merged once).
        for model_key in sorted(keys):
            full = source.whole(model_key, writer)
            if full is not None:
                converted = hf.to_checkpoint_layout(source.blueprint, {model_key: full})
                tensors.update({k: (v.to(dtype) if dtype is not None else v).contiguous()
                                for k, v in converted.items()})
            del full
        with every_rank_or_none("save_pretrained", source.device):
            if rank == writer:
                save_file(dict(sorted(tensors.items())), str(partial / filename), metadata={"format": "pt"})
        del tensors
