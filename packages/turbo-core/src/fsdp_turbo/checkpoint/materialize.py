"""Giving a meta-built model its storage, and the model's own initialisation of one module.

``torch.nn.Module.to_empty`` allocates every parameter and buffer where it lives: this
rank's shard of a sharded DTensor, this rank's experts. Values come afterwards, from a
checkpoint or from ``init_weights``. Its new tensors break ties between parameters, so
the tied names of the blueprint are tied again.
"""

from __future__ import annotations

import copy
import zlib

import torch
from torch import nn

from fsdp_turbo.core.blueprint import has_meta_tensors, release_meta_guard
from fsdp_turbo.core.device import current_device
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.model_inspect import tied_parameter_groups
from fsdp_turbo.core.patterns import base_model_name, is_peft_model
from fsdp_turbo.core.stage_part import stage_parts


def target_device(model: nn.Module) -> torch.device:
    """Where the model's tensors belong: the job's device, or the host under CPU offload."""
    state = getattr(model, "parallel_state", None)
    config = getattr(model, "fsdp_turbo_config", None)
    if state is None or (config is not None and config.fsdp_plan.cpu_offload):
        return torch.device("cpu")
    return current_device(state.device_type)


def allocate(model: nn.Module, blueprint: nn.Module) -> None:
    """Allocate the meta tensors of ``model`` (every pipeline stage this rank holds; values
    undefined) and re-tie tied parameters (a pipeline refuses tied ones)."""
    for part in stage_parts(model):
        if has_meta_tensors(part):
            part.to_empty(device=target_device(part))
            for (first_module, first), *others in tied_parameter_groups(blueprint):
                shared = getattr(part.get_submodule(first_module), first)
                for module_name, name in others:
                    module = part.get_submodule(module_name)
                    if getattr(module, name) is not shared:
                        setattr(module, name, shared)
        release_meta_guard(part)


def tensor_seed(seed: int, name: str) -> int:
    """Each tensor's own seed: its values do not depend on which other tensors a rank builds."""
    return zlib.crc32(f"{seed}:{name}".encode())


def initialized_tensor(blueprint: nn.Module, module_name: str, module: nn.Module, name: str,
                       seed: int) -> torch.Tensor:
    """Tensor ``name`` of blueprint ``module``, whole, on the host, set by the model's own
    scheme: HF's ``_init_weights`` (norms at one, ``initializer_range``, rotary
    frequencies), else ``reset_parameters()``. The module is copied with only that tensor
    allocated (the others stay on the meta device, where initialising costs nothing), so
    a rank holds one tensor at a time, drawn from its own seed. (A PEFT model's adapter
    tensors are set as PEFT sets them: ``init.set_by_module`` asks ``peft_adapters`` first.)"""
    key = f"{module_name}.{name}" if module_name else name
    if is_peft_model(blueprint):
        # seeded by its base-model name: a LoRA job's base is the full fine-tuning job's base
        key = base_model_name(key)
    fresh = copy.deepcopy(module)
    meta = getattr(fresh, name)
    allocated = torch.empty_like(meta, device="cpu")
    if name in fresh._parameters:
        fresh._parameters[name] = nn.Parameter(allocated, requires_grad=meta.requires_grad)
    else:
        fresh._buffers[name] = allocated
    init = getattr(blueprint, "_init_weights", None)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(tensor_seed(seed, key))
        if callable(init):
            init(fresh)
        elif callable(getattr(fresh, "reset_parameters", None)):
            fresh.reset_parameters()
        else:
            raise CheckpointError(f"{module_name}.{name}" if module_name else name, type(module).__name__,
                                  "give the module a reset_parameters(), or load a checkpoint",
                                  reason="the model has no _init_weights and the module no reset_parameters")
    return getattr(fresh, name).detach()
