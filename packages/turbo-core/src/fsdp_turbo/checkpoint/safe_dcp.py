"""Reading ``torch.distributed.checkpoint`` folders as data, never as code.

DCP's ``FileSystemReader`` reads ``.metadata`` with plain ``pickle``, and its default load
planner reads every non-tensor value (an optimizer's ``lr``, ``betas``, param names) with
``torch.load(weights_only=False)``: a crafted checkpoint runs whatever it names on every
rank that resumes from it. Here the metadata goes through an unpickler that builds only
the classes DCP itself writes (an allow-list, below), and non-tensor values through
``torch.load(weights_only=True)``. Tensors were already read with ``weights_only``.
Anything else is a ``CheckpointError`` naming the file, raised before anything runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fsdp_turbo.core.errors import CheckpointError

# What DCP pickles into ``.metadata`` (torch 2.9 to 2.13): its metadata dataclasses, the
# storage locations, shapes, dtypes, layouts and memory formats, and the path it was saved to.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch's own layouts by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}
METADATA = ".metadata"


def _allowed(module: str, name: str) -> bool:
    if name in _ALLOWED.get(module, ()):
        return True
    # dtypes and memory formats pickle as torch.<name>: only the real ones resolve
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not something DCP writes")
        return super().find_class(module, name)


def _refused(path: Path, error: BaseException) -> CheckpointError:
    # torch's weights_only message is a page long; the line naming the refused global is the point
    lines = str(error).splitlines()
    detail = next((line.strip() for line in lines if "Unsupported global" in line), lines[0] if lines else "")
    return CheckpointError(path.name, str(path), "resume from a checkpoint this project wrote, or start without it "
                           "(--resume none); a checkpoint is data, never code",
                           reason=f"it holds something other than checkpoint data, and nothing of it was run "
                           f"({type(error).__name__}: {detail})")


def read_metadata(path: str | Path) -> Metadata:
    """``.metadata`` of the DCP checkpoint folder ``path``, through the allow-list."""
    file = Path(path) / METADATA
    try:
        with file.open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except FileNotFoundError:
        raise CheckpointError(METADATA, str(file), "copy the checkpoint folder again, whole",
                              reason="the checkpoint has no DCP metadata") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, ImportError) as error:
        raise _refused(file, error) from None
    if not isinstance(metadata, Metadata):
        raise _refused(file, TypeError(f"it holds a {type(metadata).__name__}, not DCP Metadata"))
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read through ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: this project writes one global file
            raise FileNotFoundError(f"{self.path}: no per-rank metadata")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def __init__(self, checkpoint: str | Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = Path(checkpoint)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # What DefaultLoadPlanner.load_bytes does, with weights_only=True.
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise _refused(self.checkpoint / fqn, error) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load(state, checkpoint_id=path)`` through the safe reader and planner.

    DCP gathers every rank's read errors and raises them on every rank as one
    ``CheckpointException`` (a ``BaseException``, which ``except Exception`` misses); it
    becomes a ``CheckpointError`` naming the first failing rank's error (a refused file:
    that error itself), so every rank stops with the same clear message."""
    path = Path(path)
    read_metadata(path)  # a refused metadata file fails here, before any collective
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(path))
    except CheckpointException as error:
        # each failure is (the rank's exception, its traceback)
        failures = sorted((rank, failure[0]) for rank, failure in error.failures.items())
        refused = [e for _, e in failures if isinstance(e, CheckpointError)]
        if refused:
            raise refused[0] from None
        rank, first = failures[0]
        raise CheckpointError(path.name, str(path), "copy the checkpoint folder again, whole, or resume from another "
                              "checkpoint", reason=f"it cannot be read: on rank {rank}, {type(first).__name__}: "
                              f"{first}") from None
