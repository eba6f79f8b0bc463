"""A Hugging Face model directory's safetensors files: which file holds which tensor, with
what shape, read through safetensors' own ``get_slice``.

Everything is checked when the directory is opened, on every rank alike, before anything
is read. That covers the directory, ``config.json``, the index and the files it names
(all inside the directory: an index naming ``../x`` or ``/x`` is refused), and each
file's header. safetensors refuses a truncated file at open.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import torch

from fsdp_turbo.core.errors import CheckpointError

INDEX = "model.safetensors.index.json"
MODEL_FIX = "give a Hugging Face model directory: config.json plus model*.safetensors (and their index)"


def _safetensors():
    try:
        import safetensors
    except ImportError as err:
        raise CheckpointError("safetensors", None, "pip install 'turbo-core[hf]' (safetensors)",
                              reason="reading Hugging Face checkpoints needs safetensors") from err
    return safetensors


def _open(path: Path):
    safetensors = _safetensors()
    try:
        return safetensors.safe_open(str(path), framework="pt")
    except safetensors.SafetensorError as err:
        raise CheckpointError(path.name, str(path), "copy the file again (it is damaged or truncated)",
                              reason=f"safetensors cannot read it: {err}") from None


def _weight_map(directory: Path) -> dict[str, str] | None:
    index = directory / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(INDEX, str(index), "write it again as transformers does ({'weight_map': {...}})",
                              reason=f"it is not a safetensors index ({err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(INDEX, str(index), "map each tensor name to a file name", reason="bad weight_map")
    _check_names_stay_inside(index, weight_map)
    return weight_map


def _check_names_stay_inside(index: Path, weight_map: dict[str, str]) -> None:
    """Every file the index names is a relative path below its folder: no ``..`` part, not
    absolute, not empty. An index is data (often downloaded); it must not make a rank read
    files elsewhere on the machine.

    The check is on the names, not on resolved paths: symlinks placed in the folder are the
    folder's own (the Hugging Face hub cache makes every snapshot file a symlink into
    ``../../blobs``), and the no-index case reads ``*.safetensors`` through them alike."""
    for tensor, name in sorted(weight_map.items()):
        parts = PurePath(name).parts
        if not parts or PurePath(name).is_absolute() or ".." in parts:
            raise CheckpointError(f"{index} weight_map[{tensor!r}]", name,
                                  "write the index again naming files inside the checkpoint folder, "
                                  "e.g. model-00001-of-00002.safetensors",
                                  reason=f"that is not a file inside {index.parent}")


@dataclass
class CheckpointFiles:
    """The tensors of one checkpoint directory: file, shape and dtype of each."""

    directory: Path
    files: dict[str, Path]  # tensor -> file
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    _stack: ExitStack = field(default_factory=ExitStack, repr=False)
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> CheckpointFiles:
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError("path", str(path), MODEL_FIX, reason="no such directory")
        if not (directory / "config.json").is_file():
            raise CheckpointError("path", str(path), MODEL_FIX, reason="it has no config.json, so it is not a model")
        weight_map = _weight_map(directory)
        names = sorted(set(weight_map.values())) if weight_map is not None else sorted(
            p.name for p in directory.glob("*.safetensors"))
        if not names:
            raise CheckpointError("path", str(path), MODEL_FIX, reason="it has no *.safetensors file")
        found = cls.of_files(directory, names, reason=f"{INDEX} names it but it is not there")
        if weight_map is not None:
            wrong = sorted(k for k, name in weight_map.items() if found.files.get(k) != directory / name)
            if wrong:
                raise CheckpointError(INDEX, wrong[:8], "write the index again from the files",
                                      reason=f"{len(wrong)} tensor(s) are not in the file the index names")
        return found

    @classmethod
    def of_files(cls, directory: Path, names: list[str], *, reason: str) -> CheckpointFiles:
        """The tensors of the safetensors files ``names`` in ``directory`` (headers only);
        a missing file is a ``CheckpointError`` saying ``reason``."""
        files, shapes, dtypes = {}, {}, {}
        for name in names:
            file = directory / name
            if not file.is_file():
                raise CheckpointError(name, str(file), "copy the missing file, or the whole checkpoint, again",
                                      reason=reason)
            with _open(file) as handle:
                for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    part = handle.get_slice(key)
                    files[key], shapes[key], dtypes[key] = file, tuple(part.get_shape()), part.get_dtype()
        return cls(directory, files, shapes, dtypes)

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``key[box]``: only those bytes are read."""
        file = self.files[key]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = self._stack.enter_context(_open(file))
        return handle.get_slice(key)[box]

    def release(self) -> None:
        """Close the files. Their pages, mapped while reading, stop counting to this process."""
        self._handles.clear()
        self._stack.close()
        self._stack = ExitStack()

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(f) for f in set(self.files.values()))
