"""``load_pretrained``: a Hugging Face checkpoint into a (sharded, meta-built) model, each
rank reading only the slices of the tensors it holds."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_turbo.checkpoint.files import CheckpointFiles
from fsdp_turbo.checkpoint.init import non_persistent_buffers, set_by_module
from fsdp_turbo.checkpoint.layout import Layout, Piece, checkpoint_layout
from fsdp_turbo.checkpoint.materialize import allocate, target_device
from fsdp_turbo.checkpoint.shards import local_boxes, local_tensors, overlap
from fsdp_turbo.checkpoint.stored_forms import StoredForm, ValuesBox, stored_forms
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.blueprint import blueprint as blueprint_of
from fsdp_turbo.core.errors import CheckpointError, ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.patterns import is_peft_model
from fsdp_turbo.core.stage_part import stage_parts

_log = get_logger(__name__)
# Mapped file pages count as this process's memory until the file is closed: close the
# files after this many bytes have been read, so the peak stays near this rank's share.
RELEASE_EVERY = 16 * 2**20


@dataclass(frozen=True)
class LoadReport:
    """What ``load_pretrained`` did on this rank."""

    read_bytes: int  # checkpoint bytes this rank read
    checkpoint_bytes: int  # the checkpoint's size on disk
    missing: tuple[str, ...]  # model tensors not in the checkpoint (strict=False): initialised instead
    unexpected: tuple[str, ...]  # checkpoint tensors the model has no place for (strict=False): ignored


def _ignored(model: nn.Module, attribute: str) -> list[re.Pattern]:
    # transformers' own lists of checkpoint keys a model tolerates missing or extra.
    return [re.compile(p) for p in getattr(model, attribute, None) or ()]


def _compare(layout: Layout, files: CheckpointFiles, model: nn.Module, strict: bool
             ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Missing and unexpected checkpoint tensors; raises on a shape mismatch, and with
    ``strict`` on either list. The same on every rank: it reads only headers."""
    expected = layout.checkpoint_shapes
    skip_missing, skip_unexpected = (_ignored(model, "_keys_to_ignore_on_load_missing"),
                                     _ignored(model, "_keys_to_ignore_on_load_unexpected"))
    missing = tuple(k for k in expected if k not in files.shapes and not any(p.search(k) for p in skip_missing))
    unexpected = tuple(k for k in files.shapes
                       if k not in expected and not any(p.search(k) for p in skip_unexpected))
    misshapen = [f"{k}: checkpoint {files.shapes[k]}, model {shape}" for k, shape in expected.items()
                 if k in files.shapes and tuple(files.shapes[k]) != shape]
    if misshapen:
        raise CheckpointError(misshapen[0].split(":")[0], misshapen[:8], "load a checkpoint of this model's config",
                              reason=f"{len(misshapen)} tensor(s) have another shape than the model's")
    if strict and (missing or unexpected):
        what = (f"{len(missing)} missing ({list(missing[:8])})" if missing else "") + (
            "; " if missing and unexpected else "") + (
            f"{len(unexpected)} unexpected ({list(unexpected[:8])})" if unexpected else "")
        raise CheckpointError("checkpoint", str(files.directory),
                              "load a checkpoint of this model, or pass strict=False to initialise what is missing "
                              "and ignore what is extra", reason=f"tensors do not match the model: {what}")
    return missing, unexpected


def _read_piece(files: CheckpointFiles, piece: Piece, box) -> int:
    """Copy the part of ``piece`` inside this rank's ``box`` (a LocalBox); returns bytes read."""
    met = overlap(piece.start, piece.size, box.start, box.size)
    if met is None:
        return 0
    start, size = met
    source = tuple(slice(start[d] - piece.start[d], start[d] - piece.start[d] + size[d]) for d in piece.kept)
    data = files.read(piece.key, source)
    target = box.tensor[tuple(slice(s - b, s - b + n) for s, n, b in zip(start, size, box.start, strict=True))]
    with torch.no_grad():
        target.copy_(data.reshape(target.shape))
    return data.numel() * data.element_size()


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                    adapter: str | os.PathLike | None = None) -> LoadReport:
    """Load the Hugging Face checkpoint at ``path`` into ``model``. A collective: call it on
    every rank.

    ``model`` may come straight from the meta device through ``FSDPTurbo``: it is
    materialised here (``to_empty``), then each rank reads, with safetensors' ``get_slice``,
    only the slices of its own shards. Checkpoints in transformers' layout load (per-expert
    MoE tensors become the fused ones), and so do checkpoints in the model's own layout.
    Values are converted to the model's dtypes; tied weights are read once; non-persistent
    buffers (rotary frequencies) are rebuilt by the model's own initialisation.

    For a PEFT model (``get_peft_model``), ``path`` is the base model's checkpoint (its own
    names: no ``base_model.model.`` prefix, no ``base_layer``), read into the frozen weights;
    ``adapter``, a folder ``PeftModel.save_pretrained`` wrote, is read into the active
    adapter's weights, its ``adapter_config.json`` checked against the model's LoraConfig.
    Without ``adapter`` the adapters are initialised as PEFT does (``init_lora_weights``).

    A missing, unexpected or misshapen tensor, a missing or truncated file, or a directory
    that is not a model raises ``CheckpointError`` on every rank, before anything is read;
    where only some ranks find the fault, the others raise ``PeerFailure`` with its message.
    With ``strict=False`` missing tensors are initialised as ``init_weights`` would and
    unexpected ones ignored, each named in one warning (an adapter folder is always strict).
    """
    device = target_device(model)
    # Checked on every rank, then agreed on: a file one node cannot see (another disk, a
    # copy in progress) stops every rank at once, not at the next collective's timeout.
    with every_rank_or_none("load_pretrained", device):
        files = CheckpointFiles.open(path)
        blueprint = blueprint_of(model)
        layout, adapter_part, initialised = _layouts(blueprint, files, adapter)
        missing, unexpected = _compare(layout, files, model, strict)
    allocate(model, blueprint)
    forms = stored_forms(model)
    read = 0
    with every_rank_or_none("load_pretrained", device):
        rebuild = non_persistent_buffers(blueprint) | initialised | {
            k for k, pieces in layout.pieces.items() if any(p.key in set(missing) for p in pieces)}
        for part in stage_parts(model):  # a pipeline's stages one by one: see local_tensors
            local = local_tensors(part)
            read += _read_layout(layout, files, local, forms, set(missing))
            if adapter_part is not None:
                read += _read_layout(*adapter_part, local, forms, set())
            set_by_module(part, blueprint, local, rebuild, seed=0)
    if missing or unexpected:
        _log.warning(f"load_pretrained (strict=False): initialised {len(missing)} missing tensor(s) "
                     f"{list(missing[:8])}, ignored {len(unexpected)} unexpected {list(unexpected[:8])}")
    nbytes = files.nbytes + (adapter_part[1].nbytes if adapter_part is not None else 0)
    return LoadReport(read, nbytes, missing, unexpected)


def _layouts(blueprint: nn.Module, files: CheckpointFiles, adapter: str | os.PathLike | None
             ) -> tuple[Layout, tuple[Layout, CheckpointFiles] | None, set[str]]:
    """Where the checkpoint's tensors go; for a PEFT model also the adapter folder's, and the
    adapter tensors to initialise (those of the adapters no folder gives)."""
    if not is_peft_model(blueprint):
        if adapter is not None:
            raise ConfigError("adapter", os.fspath(adapter), "pass adapter only for a PEFT model (get_peft_model)",
                              reason=f"{type(blueprint).__name__} has no adapters")
        return _own_layout(checkpoint_layout(blueprint), files), None, set()
    from fsdp_turbo.checkpoint import peft_adapters

    view = peft_adapters.peft_view(blueprint)
    layout = peft_adapters.in_model_keys(_own_layout(checkpoint_layout(view.base), files), view)
    initialised = peft_adapters.adapter_model_keys(blueprint)
    if adapter is None:
        return layout, None, initialised
    adapter_files, adapter_layout = peft_adapters.open_adapter(blueprint, adapter)
    return layout, (adapter_layout, adapter_files), initialised - set(adapter_layout.pieces)


def _read_layout(layout: Layout, files: CheckpointFiles, local: dict[str, torch.Tensor],
                 forms: dict[str, StoredForm], absent: set[str]) -> int:
    """Read this rank's boxes of every piece of ``layout`` (but the ``absent`` ones); returns bytes read.
    A stored-form parameter (QLoRA-MX) is read as values, then encoded into its shard."""
    read = since_release = 0
    for model_key, pieces in layout.pieces.items():
        if model_key not in local:
            continue  # another rank's experts
        for box in local_boxes(local[model_key]):
            target = ValuesBox(box, forms.get(model_key))
            for piece in pieces:
                if piece.key in absent:
                    continue
                done = _read_piece(files, piece, target.box)
                read, since_release = read + done, since_release + done
                if since_release > RELEASE_EVERY:
                    files.release()
                    since_release = 0
            target.commit()
    files.release()
    return read


def _own_layout(layout: Layout, files: CheckpointFiles) -> Layout:
    """A checkpoint already in the model's own layout (fused experts under the model's
    names, as older exports wrote) is read as it stands."""
    expected = layout.checkpoint_shapes
    if set(expected) <= set(files.shapes):
        return layout
    own = {key: (Piece(key, (0,) * len(pieces_shape), pieces_shape, tuple(range(len(pieces_shape)))),)
           for key, pieces_shape in _model_shapes(layout).items()}
    if set(own) <= set(files.shapes):
        return Layout(own)
    return layout


def _model_shapes(layout: Layout) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key, pieces in layout.pieces.items():
        ends = [tuple(s + n for s, n in zip(p.start, p.size, strict=True)) for p in pieces]
        shapes[key] = tuple(max(end[d] for end in ends) for d in range(len(ends[0])))
    return shapes
