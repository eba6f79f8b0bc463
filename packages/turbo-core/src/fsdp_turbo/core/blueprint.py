"""The model as FSDPTurbo received it, kept on the meta device, and the guard on a model
that is not materialised yet.

The transforms change the model in place: parameters become sharded DTensors, EP ranks
keep only their experts, classes gain mix-ins, the config's attention name may change. The
blueprint is a meta-device copy of the model as it was handed in. It keeps every module,
name, global shape and dtype, the untouched config, and which parameters are tied, and it
holds no storage. Checkpoint loading and saving read the global layout from it, and
``init_weights`` runs the model's own initialisation on copies of its modules.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

BLUEPRINT_ATTR = "_fsdp_turbo_blueprint"
_GUARD_ATTR = "_fsdp_turbo_meta_guard"


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (no data
    is copied; tied parameters stay tied)."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def record_blueprint(model: nn.Module) -> None:
    # In __dict__, not as a submodule: the blueprint must stay out of state_dict,
    # parameters() and every transform's view of the model.
    model.__dict__[BLUEPRINT_ATTR] = meta_copy(model)


def blueprint(model: nn.Module) -> nn.Module:
    """The recorded blueprint, else (a model that never went through FSDPTurbo, so is
    still in its original form) a meta copy of ``model`` itself."""
    recorded = model.__dict__.get(BLUEPRINT_ATTR)
    return recorded if recorded is not None else meta_copy(model)


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


class NotMaterializedError(RuntimeError):
    """The model was built on the meta device and has no weights yet."""


def _refuse_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    raise NotMaterializedError(
        f"{type(module).__name__} was built on the meta device and has no weights yet. Fix: call "
        "fsdp_turbo.checkpoint.load_pretrained(model, path) or fsdp_turbo.checkpoint.init_weights(model) first")


def guard_meta_model(model: nn.Module) -> None:
    """Make a forward on a meta model fail with a clear error. Prepended, so it runs before
    every other hook (FSDP's all-gather of meta tensors would fail obscurely)."""
    if _GUARD_ATTR not in model.__dict__:
        model.__dict__[_GUARD_ATTR] = model.register_forward_pre_hook(_refuse_forward, prepend=True,
                                                                      with_kwargs=True)


def release_meta_guard(model: nn.Module) -> None:
    handle = model.__dict__.pop(_GUARD_ATTR, None)
    if handle is not None:
        handle.remove()
