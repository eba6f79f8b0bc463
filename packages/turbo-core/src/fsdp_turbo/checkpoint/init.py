"""``init_weights``: random weights for a meta-built model, the same at every layout; and
``materialize``, storage without values for a caller that fills it itself."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_turbo.checkpoint.materialize import allocate, initialized_tensor, target_device
from fsdp_turbo.checkpoint.shards import local_boxes, local_tensors
from fsdp_turbo.checkpoint.stored_forms import ValuesBox, stored_forms
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.blueprint import blueprint as blueprint_of
from fsdp_turbo.core.patterns import is_peft_model
from fsdp_turbo.core.stage_part import stage_parts


def set_by_module(model: nn.Module, blueprint: nn.Module, local: dict[str, torch.Tensor], names: set[str] | None,
                  seed: int) -> None:
    """Set each of ``names`` (None: every tensor) that this rank holds, as the model's own
    initialisation sets it: the tensor is made whole on the host under its own seed, and
    this rank's box of it is copied in. A tensor shared by several modules (tied) is set
    once, by the first. A stored-form parameter (QLoRA-MX) gets its box of values encoded."""
    done: set[int] = set()
    forms = stored_forms(model)
    for module_name, module in blueprint.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, original in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            if id(original) in done or prefix + name not in local or (names is not None and prefix + name not in names):
                continue
            done.add(id(original))
            whole = _initialized(blueprint, module_name, module, name, seed)
            for stored in local_boxes(local[prefix + name]):
                target = ValuesBox(stored, forms.get(prefix + name))
                box = target.box
                with torch.no_grad():
                    box.tensor.copy_(whole[tuple(slice(s, s + n) for s, n in zip(box.start, box.size, strict=True))])
                target.commit()
            del whole


def _initialized(blueprint: nn.Module, module_name: str, module: nn.Module, name: str, seed: int) -> torch.Tensor:
    """The model's own scheme, but a PEFT model's adapter tensors as PEFT sets them
    (``init_lora_weights``), not by the base model's scheme."""
    if is_peft_model(blueprint):
        from fsdp_turbo.checkpoint.peft_adapters import adapter_tensor

        adapter = adapter_tensor(blueprint, module_name, name, seed)
        if adapter is not None:
            return adapter
    return initialized_tensor(blueprint, module_name, module, name, seed)


def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Initialise ``model`` (built on the meta device, through ``FSDPTurbo`` or not) by its own
    scheme: HF's ``_init_weights`` (``initializer_range``, norms at one, rotary
    frequencies), else each module's ``reset_parameters()``.

    Every tensor draws from its own seed (``seed`` and its name), so the full weights are the
    same at every layout, and equal to a one-process model initialised here. A rank builds
    one tensor at a time whole on the host, keeps its own shard and drops the rest: its peak
    is its share plus the largest tensor. A collective: call it on every rank.
    """
    blueprint = blueprint_of(model)
    allocate(model, blueprint)
    with every_rank_or_none("init_weights", target_device(model)):
        for part in stage_parts(model):
            set_by_module(part, blueprint, local_tensors(part), None, seed)
    return model


def materialize(model: nn.Module) -> nn.Module:
    """Allocate a meta-built model's tensors without values, for a caller that fills them
    itself (a ``torch.distributed.checkpoint`` resume); the non-persistent buffers, which
    no checkpoint holds, are rebuilt by the model's own initialisation. A collective."""
    blueprint = blueprint_of(model)
    allocate(model, blueprint)
    with every_rank_or_none("materialize", target_device(model)):
        for part in stage_parts(model):
            set_by_module(part, blueprint, local_tensors(part), non_persistent_buffers(blueprint), seed=0)
    return model


def non_persistent_buffers(model: nn.Module) -> set[str]:
    names = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        names.update(prefix + n for n in module._non_persistent_buffers_set)
    return names
