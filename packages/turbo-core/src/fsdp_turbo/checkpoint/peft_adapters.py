"""PEFT (LoRA) models in ``fsdp_turbo.checkpoint``: adapters saved as PEFT saves them, the
merged model saved as transformers saves it, and a base checkpoint plus an adapter folder
loaded into a meta-built, sharded PEFT model.

Three names meet here. The *model key* is the PEFT model's own
(``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``).
The *base key* is the base model's (``model.layers.0.self_attn.q_proj.weight``): PEFT's prefix
and its ``base_layer`` segments dropped, as ``core.patterns`` sees a PEFT model; base
checkpoints and merged models use it. The *adapter key* is what PEFT's
``get_peft_model_state_dict`` writes (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``):
PEFT computes it here, on the meta blueprint, and the tensor it returns tells which model key
it is. peft is imported only in here, and only for a PEFT model, which cannot exist without it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.checkpoint.atomic import move_into_place
from fsdp_turbo.checkpoint.files import CheckpointFiles
from fsdp_turbo.checkpoint.gather import holders as holders_of
from fsdp_turbo.checkpoint.gather import whole, world
from fsdp_turbo.checkpoint.layout import Layout, Piece
from fsdp_turbo.checkpoint.materialize import target_device, tensor_seed
from fsdp_turbo.checkpoint.shards import local_tensors
from fsdp_turbo.checkpoint.stored_forms import stored_forms
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.model_inspect import is_tuner_layer
from fsdp_turbo.core.patterns import TUNER_SEGMENT, base_model_name

ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.CONFIG_NAME
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.SAFETENSORS_WEIGHTS_NAME
ADAPTER_FIX = ("give the folder PeftModel.save_pretrained (or fsdp_turbo.checkpoint.save_pretrained) wrote for a "
               "model built with the same LoraConfig (LoraConfig.from_pretrained(folder) rebuilds it)")
# adapter_config.json fields that decide the adapter tensors' names, shapes or effect; the
# others (dropout, init, inference_mode, base_model_name_or_path, ...) do not change what loads.
CONFIG_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
                 "exclude_modules", "layers_to_transform", "layers_pattern", "target_parameters", "use_dora",
                 "lora_bias", "fan_in_fan_out", "bias", "modules_to_save", "trainable_token_indices")
LORA_DICTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


base_key = base_model_name  # a PEFT model's tensor name as the base model has it


def _is_tuner_layer(module: nn.Module) -> bool:
    # PEFT's BaseTunerLayer, by shape: it wraps base_layer and can merge into it.
    return is_tuner_layer(module) and callable(getattr(module, "merge", None))


@dataclass(frozen=True)
class PeftView:
    """A PEFT blueprint seen as its base model."""

    base: nn.Module  # the base transformers model on the meta device (PEFT's unload of a copy)
    model_keys: dict[str, str]  # base key -> model key
    layers: dict[str, str]  # model key of each base_layer tensor -> its tuner layer's module name


def peft_view(blueprint: nn.Module) -> PeftView:
    """The base model inside PEFT blueprint ``blueprint``, with each base key's model key."""
    base = copy.deepcopy(blueprint).unload()  # PEFT's own: tuner layers replaced by their base layers
    state = blueprint.state_dict(keep_vars=True)
    by_base = {base_key(k): k for k in state}
    expected = list(base.state_dict(keep_vars=True))
    model_keys = {k: by_base[k] for k in expected if k in by_base}
    unplaced = [k for k in expected if k not in model_keys]
    if unplaced:
        raise CheckpointError(unplaced[0], unplaced[:8], "keep such modules out of the PEFT config "
                              "(modules_to_save, trainable_token_indices), or save and load with PEFT on one process",
                              reason="the PEFT model holds these base tensors in a wrapper fsdp_turbo.checkpoint "
                              "does not read yet")
    return PeftView(base, model_keys, _base_layer_tensors(blueprint, state))


def _base_layer_tensors(blueprint: nn.Module, state: dict[str, Any]) -> dict[str, str]:
    """Model key of each tensor inside an outermost tuner layer's ``base_layer`` -> that layer
    (a nested tuner layer, such as stacked ParamWrappers, belongs to the outermost)."""
    outermost: set[str] = set()
    for name, module in blueprint.named_modules():
        parts = name.split(".")
        if _is_tuner_layer(module) and not any(".".join(parts[:i]) in outermost for i in range(1, len(parts))):
            outermost.add(name)
    layers = {}
    for key in state:
        parts = key.split(".")
        owner = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in outermost), None)
        if owner is not None and key.startswith(f"{owner}.{TUNER_SEGMENT}."):
            layers[key] = owner
    return layers


def in_model_keys(layout: Layout, view: PeftView) -> Layout:
    """A base-model ``layout`` with each model tensor under its PEFT model key."""
    return Layout({view.model_keys[k]: pieces for k, pieces in layout.pieces.items()})


def adapter_keys(blueprint: nn.Module, adapter: str, save_embedding_layers: bool | str) -> dict[str, str]:
    """Adapter key -> model key, by PEFT's ``get_peft_model_state_dict`` on the meta blueprint."""
    from peft import get_peft_model_state_dict

    state = blueprint.state_dict(keep_vars=True)
    key_of: dict[int, str] = {}
    for key, tensor in state.items():
        key_of.setdefault(id(tensor), key)
    named = get_peft_model_state_dict(blueprint, state_dict=state, adapter_name=adapter,
                                      save_embedding_layers=save_embedding_layers)
    unknown = [k for k, v in named.items() if id(v) not in key_of]
    if unknown:
        raise CheckpointError(unknown[0], unknown[:8], "report this PEFT version",
                              reason="get_peft_model_state_dict returned tensors that are not the model's")
    return {name: key_of[id(tensor)] for name, tensor in named.items()}


def adapter_model_keys(blueprint: nn.Module) -> set[str]:
    """The model keys of every adapter's tensors (what a base checkpoint does not hold)."""
    return {k for adapter in blueprint.peft_config for k in adapter_keys(blueprint, adapter, False).values()}


# ----- save ------------------------------------------------------------------------------------------
def _from_first_rank(what: str, compute, device: torch.device):
    """``compute()`` on rank 0, its result on every rank. For PEFT's naming with
    ``save_embedding_layers="auto"``, which may ask the Hub about the base model: asked once,
    so every rank gathers the same tensors."""
    size, rank = world()
    result = None
    with every_rank_or_none(what, device):
        if rank == 0:
            result = compute()
    if size > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def save_adapters(model: nn.Module, blueprint: nn.Module, path: str | os.PathLike, *,
                  dtype: torch.dtype | None = None) -> Path:
    """Every adapter of PEFT ``model``, written by PEFT's ``PeftModel.save_pretrained`` on rank 0
    from its whole tensors (gathered one at a time, each from the ranks that hold it): the
    same files, names, config and model card as PEFT writes from a model on one process."""
    _, rank = world()
    device = target_device(model)
    local = local_tensors(model)
    names = _from_first_rank("save_pretrained", lambda: {
        adapter: adapter_keys(blueprint, adapter, "auto") for adapter in blueprint.peft_config}, device)
    wanted = sorted({k for keys in names.values() for k in keys.values()})
    holders = holders_of(wanted, local)
    meta = blueprint.state_dict(keep_vars=True)
    state: dict[str, torch.Tensor] = {}
    for key in wanted:
        full = whole(local.get(key), holders.get(key), meta[key], device)
        if rank == 0:
            state[key] = full.to(dtype) if dtype is not None else full
        del full
    # PEFT adds the base model's embeddings where "auto" found them (above); say which, so
    # it does not ask again.
    adapter_tensors = adapter_model_keys(blueprint)
    embeddings = any(k not in adapter_tensors for k in wanted)
    target, partial = Path(path), Path(f"{os.fspath(path)}.partial")
    with every_rank_or_none("save_pretrained", device):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            blueprint.save_pretrained(str(partial), state_dict=state, save_embedding_layers=embeddings)
            move_into_place(partial, target)
    return target


class MergedTensors:
    """The tensors of a PEFT model's base model with the active adapters merged, by base key;
    ``whole`` is a collective. A tuner layer's tensors are gathered together, and the writer
    merges them by PEFT's own ``merge`` on a host copy of that layer (one layer at a time)."""

    def __init__(self, model: nn.Module, blueprint: nn.Module, device: torch.device) -> None:
        self.view = peft_view(blueprint)
        self.peft, self.blueprint, self.device = blueprint, self.view.base, device
        self.local, self.forms = local_tensors(model), stored_forms(model)
        self.meta = blueprint.state_dict(keep_vars=True)
        self.holders = holders_of(list(self.meta), self.local)
        self._merged: tuple[tuple[str, int], dict[str, torch.Tensor]] | None = None

    def _gather(self, model_key: str, keep: bool) -> torch.Tensor | None:
        full = whole(self.local.get(model_key), self.holders.get(model_key), self.meta[model_key], self.device,
                     self.forms.get(model_key))
        return full if keep else None

    def whole(self, key: str, writer: int) -> torch.Tensor | None:
        """Base tensor ``key``, merged, whole on the host of rank ``writer`` (None elsewhere);
        every rank calls it. A layer's tensors are gathered once per (layer, writer): the
        same on every rank, so every rank takes the same collectives."""
        keep = world()[1] == writer
        model_key = self.view.model_keys[key]
        layer = self.view.layers.get(model_key)
        if layer is None:
            return self._gather(model_key, keep)
        if self._merged is None or self._merged[0] != (layer, writer):
            self._merged = ((layer, writer), self._merge(layer, keep))
        return self._merged[1][key] if keep else None

    def _merge(self, layer: str, keep: bool) -> dict[str, torch.Tensor]:
        """Tuner layer ``layer`` merged (PEFT's ``merge`` of the active adapters), by base key."""
        prefix = f"{layer}."
        gathered = {k[len(prefix):]: self._gather(k, keep) for k in self.meta if k.startswith(prefix)}
        if not keep:
            return {}
        fresh = copy.deepcopy(self.peft.get_submodule(layer)).to_empty(device="cpu")
        fresh.load_state_dict(gathered, strict=True)
        with torch.no_grad():
            unloaded = _merged_module(fresh)
        name = base_key(layer)
        return {f"{name}.{k}": v.detach() for k, v in unloaded.state_dict().items()}


def _merged_module(layer: nn.Module) -> nn.Module:
    # PEFT's merge_and_unload for one target (BaseTuner._unload_and_optionally_merge): a layer
    # with its own unloading (nested ParamWrappers on MoE experts) merges its whole chain.
    if hasattr(layer, "unload_and_optionally_merge_module"):
        return layer.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
    layer.merge()
    return layer.get_base_layer()


# ----- load ------------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    # Config values as JSON has them: sets and tuples become sorted lists, enums their value.
    if isinstance(value, set | tuple | list):
        return sorted(_plain(v) for v in value)
    return getattr(value, "value", value)


def _adapter_config(folder: Path):
    from peft import PeftConfig

    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        raise CheckpointError("adapter", str(folder), ADAPTER_FIX, reason=f"it has no {ADAPTER_CONFIG}")
    try:
        return PeftConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, KeyError, json.JSONDecodeError) as err:
        raise CheckpointError(ADAPTER_CONFIG, str(file), ADAPTER_FIX,
                              reason=f"PEFT cannot read it ({type(err).__name__}: {err})") from None


def _check_config(folder: Path, saved, model_config) -> None:
    """The adapter's config against the model's, field by field (``CONFIG_FIELDS``)."""
    for name in CONFIG_FIELDS:
        theirs, ours = _plain(getattr(saved, name, None)), _plain(getattr(model_config, name, None))
        if theirs != ours:
            raise CheckpointError(f"{folder / ADAPTER_CONFIG}: {name}", theirs, ADAPTER_FIX,
                                  reason=f"the model's LoraConfig has {name}={ours!r}")


def _check_tensors(folder: Path, files: CheckpointFiles, required: dict[str, str], optional: dict[str, str],
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """The adapter keys to read (adapter key -> model key): every required one there, none
    the model has no place for, each in the model's shape."""
    file = folder / ADAPTER_WEIGHTS
    missing = [k for k in required if k not in files.shapes]
    if missing:
        raise CheckpointError(f"{file}: {missing[0]}", missing[:8], ADAPTER_FIX,
                              reason=f"{len(missing)} adapter tensor(s) of the model are not in the file")
    unexpected = [k for k in files.shapes if k not in required and k not in optional]
    if unexpected:
        raise CheckpointError(f"{file}: {unexpected[0]}", unexpected[:8], ADAPTER_FIX,
                              reason=f"{len(unexpected)} tensor(s) in the file have no place in the model")
    reading = {k: (required | optional)[k] for k in files.shapes}
    misshapen = [f"{k}: file {files.shapes[k]}, model {shapes[m]}" for k, m in reading.items()
                 if tuple(files.shapes[k]) != shapes[m]]
    if misshapen:
        raise CheckpointError(f"{file}: {misshapen[0].split(':')[0]}", misshapen[:8], ADAPTER_FIX,
                              reason=f"{len(misshapen)} adapter tensor(s) have another shape than the model's")
    return reading


def open_adapter(blueprint: nn.Module, path: str | os.PathLike) -> tuple[CheckpointFiles, Layout]:
    """The adapter folder ``path`` for the model's active adapter: its files and where each
    tensor goes. Every name, shape and config field is checked here (headers only, no
    collective); a mismatch is a ``CheckpointError`` naming the file, the key and the fix."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError("adapter", str(path), ADAPTER_FIX, reason="no such directory")
    adapter = blueprint.active_adapter
    _check_config(folder, _adapter_config(folder), blueprint.peft_config[adapter])
    files = CheckpointFiles.of_files(folder, [ADAPTER_WEIGHTS], reason=f"an adapter folder holds {ADAPTER_WEIGHTS}")
    required = adapter_keys(blueprint, adapter, False)
    # PEFT saves the embeddings beside the adapter when they were targeted or resized: read them too.
    optional = adapter_keys(blueprint, adapter, True)
    shapes = {k: tuple(t.shape) for k, t in blueprint.state_dict(keep_vars=True).items()}
    reading = _check_tensors(folder, files, required, optional, shapes)
    pieces = {model_key: (Piece(key, (0,) * len(shapes[model_key]), shapes[model_key],
                                tuple(range(len(shapes[model_key])))),) for key, model_key in reading.items()}
    return files, Layout(pieces)


# ----- initialisation ----------------------------------------------------------------------------------
def _init_scheme(blueprint: nn.Module, adapter: str, key: str) -> bool | str:
    scheme = blueprint.peft_config[adapter].init_lora_weights
    if scheme is True or scheme is False or (isinstance(scheme, str) and scheme.lower() == "gaussian"):
        return scheme
    raise CheckpointError(key, scheme, "load the adapter with load_pretrained(model, base, adapter=folder) (save it "
                          "from a model initialised on one process), or use init_lora_weights True, False or "
                          "'gaussian'", reason=f"init_lora_weights={scheme!r} needs the whole base weights")


def adapter_tensor(blueprint: nn.Module, module_name: str, name: str, seed: int) -> torch.Tensor | None:
    """An adapter tensor of a LoRA layer, whole, on the host, set as PEFT sets it
    (``init_lora_weights``: True, 'gaussian', or False for the layers' own default), drawn from
    the tensor's own seed; None when ``module_name.name`` is not a LoRA adapter tensor."""
    parts = module_name.split(".")
    if len(parts) >= 2 and parts[-1] in LORA_DICTS:  # a ParameterDict: the name is the adapter's
        layer_name, dict_name, adapter = ".".join(parts[:-1]), parts[-1], name
    elif len(parts) >= 3 and parts[-2] in LORA_DICTS:  # a ModuleDict of adapter modules
        layer_name, dict_name, adapter = ".".join(parts[:-2]), parts[-2], parts[-1]
    else:
        if "lora_magnitude_vector" in parts:
            raise CheckpointError(f"{module_name}.{name}", "DoRA", "load the adapter with "
                                  "load_pretrained(model, base, adapter=folder)",
                                  reason="DoRA's magnitudes come from the whole base weights")
        return None
    key = f"{module_name}.{name}"
    layer = copy.deepcopy(blueprint.get_submodule(layer_name))  # on the meta device: costs nothing
    scheme = _init_scheme(blueprint, adapter, key)
    for dict_name_ in LORA_DICTS:  # the adapter's tensors only; the base layer stays on meta
        entries = getattr(layer, dict_name_, None)
        if entries is not None and adapter in entries:
            if isinstance(entries, nn.ParameterDict):
                entries[adapter] = nn.Parameter(torch.empty_like(entries[adapter], device="cpu"))
            else:
                entries[adapter].to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(tensor_seed(seed, key))
        if scheme is False:
            _default_init(layer, adapter)
        else:
            layer.reset_lora_parameters(adapter, scheme)
    entry = getattr(layer, dict_name)[adapter]
    return (entry if isinstance(entry, torch.Tensor) else getattr(entry, name)).detach()


def _default_init(layer: nn.Module, adapter: str) -> None:
    # init_lora_weights=False keeps what PEFT's layers start with: nn.Linear's own init for
    # lora_A/lora_B, standard normal for an Embedding's lora_embedding_A/B.
    for dict_name in LORA_DICTS:
        entries = getattr(layer, dict_name, None)
        if entries is None or adapter not in entries:
            continue
        if isinstance(entries, nn.ParameterDict):
            nn.init.normal_(entries[adapter])
        else:
            entries[adapter].reset_parameters()
