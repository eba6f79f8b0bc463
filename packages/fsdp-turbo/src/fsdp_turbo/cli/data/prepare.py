"""Tokenize and pack each source once, and keep the result in a cache.

Two digests describe a prepared source, both over the tokenizer's fingerprint, the source's
fields, ``seq_len``, ``packing``, ``overflow`` and ``max_bytes`` and, for an SFT source whose
job sets another ``turbo.model_facts.ignore_index`` than the default, that value (its cached
labels hold it; a text source's hold none, and the default adds nothing, so the caches and
checkpoints of the default keep their keys and identities):

- the cache key, where the result lives, adds the state of each file: path, size, mtime,
  inode and ctime. A file rewritten in place gets a new ctime, which ``os.utime`` cannot set
  back, and a file replaced by another a new inode. Nothing is read: a start costs a
  ``stat`` a file, however large the corpus.
- the data identity, what the tokens are, adds instead a digest of the files' contents,
  read once when the source is built and kept in the entry. A copy of the files (another
  node, another folder) has the same identity, and a resume checks the identity
  (``TrainStream.load_state_dict``), not the key.

``CACHE/<key>/`` holds the tokens (an Arrow file, memory-mapped when read), the windows
(``windows.npz``), ``stats.json`` and, written last, ``manifest.json`` (the format, the
identity and each file's size). It is built in ``<key>.partial.<pid>``, flushed to disk
and renamed, so it is never seen half-written; a partial folder is removed when its build
fails, and by the next build of that key when its process died. An entry that is damaged
nevertheless (a file truncated, missing or garbled) is found when it is opened, reported
once and built again; if it is still unreadable, a ``ConfigError`` names the folder.

Every rank of every node calls ``prepare_source`` before any process group exists. A file
lock per entry makes one process do the work while the others wait for it, at most
``data.cache_lock_timeout_s``; they then find the cache. A bad source fails in the process
that holds the lock, and then again, identically, in each of the others, so every rank
reports the same error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_turbo.checkpoint.atomic import fsync_path
from fsdp_turbo.cli.data.chat import check_messages, render_conversation
from fsdp_turbo.cli.data.packing import Windows, cut_documents, pack
from fsdp_turbo.cli.data.sources import check_columns, load_table, resolve_files
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import IGNORE_INDEX

_log = get_logger(__name__)
FORMAT = 2  # bump when the cached layout changes
TOKENS, WINDOWS, STATS, MANIFEST = "tokens.arrow", "windows.npz", "stats.json", "manifest.json"
FileState = tuple[str, int, int, int, int]  # path, size, mtime, inode, ctime (ns)


@dataclass(frozen=True)
class SourceSpec:
    """What one source is, for preparing it: the job's section plus where it stands."""

    field: str  # "data.sources[0]": names the source in errors
    paths: tuple[str, ...]  # globs, or one save_to_disk folder
    text_field: str | None
    messages_field: str | None
    max_bytes: int | None = None  # the ``files`` shorthand only

    @property
    def sft(self) -> bool:
        return self.messages_field is not None

    @property
    def path_field(self) -> str:
        return self.field if self.field == "data.files" else f"{self.field}.path"

    @property
    def path(self) -> str | list[str]:
        return self.paths[0] if len(self.paths) == 1 else list(self.paths)


@dataclass(frozen=True)
class PreparedSource:
    spec: SourceSpec
    key: str  # the cache entry's folder name
    identity: str  # what the tokens are, the same for a copy of the files (what a resume checks)
    # pyarrow.Table: input_ids (and labels for SFT), memory-mapped. Read with pyarrow, not
    # datasets: each rank opens it at start, and datasets' import alone costs 0.5 s there.
    tokens: Any
    windows: Windows
    stats: dict[str, int]
    built: bool  # this process tokenized it (False: it found the cache)


class _Damaged(Exception):
    """A cache entry that cannot be read (the message says why); handled in this module."""


@dataclass(frozen=True)
class _Entry:
    identity: str
    tokens: Any
    windows: Windows
    stats: dict[str, int]


def _digest(described: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


def _settings(spec: SourceSpec, tokenizer, seq_len: int, packing: bool, overflow: str,
              ignore_index: int) -> dict[str, Any]:
    """What the result depends on besides the files."""
    settings = {"format": FORMAT, "tokenizer": tokenizer.fingerprint, "text_field": spec.text_field,
                "messages_field": spec.messages_field, "max_bytes": spec.max_bytes, "seq_len": seq_len,
                "packing": packing, "overflow": overflow}
    if spec.sft and ignore_index != IGNORE_INDEX:  # SFT labels hold it (see the module's docstring)
        settings["ignore_index"] = ignore_index
    return settings


def files_state(files: list[Path]) -> list[FileState]:
    """Each file's (path, size, mtime, inode, ctime): any write changes the ctime, which
    ``os.utime`` cannot set back; a replaced file has another inode."""
    states = []
    for path in files:
        stat = path.stat()
        states.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns))
    return states


def content_digest(files: list[Path]) -> str:
    """The files' contents in order, read in blocks: the same for any copy of them."""
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def cache_key(settings: dict[str, Any], state: list[FileState]) -> str:
    return _digest({**settings, "files": state})


def _limit_files(table, spec: SourceSpec):
    """The ``files`` shorthand's ``max_bytes``: the files in order, the last one cut, until
    that many bytes (of UTF-8 text)."""
    if spec.max_bytes is None:
        return table
    sizes = np.cumsum([len(text.encode("utf-8")) for text in table["text"]])
    keep = min(int(np.searchsorted(sizes, spec.max_bytes)) + 1, len(sizes))
    budget = spec.max_bytes - (int(sizes[keep - 2]) if keep > 1 else 0)

    def cut(row: dict, index: int) -> dict:
        if index < keep - 1:
            return row
        return {"text": row["text"].encode("utf-8")[:budget].decode("utf-8", errors="ignore")}

    return table.select(range(keep)).map(cut, with_indices=True, keep_in_memory=True)


def _tokenize(table, spec: SourceSpec, tokenizer, out: Path, ignore_index: int):
    if spec.sft and tokenizer.chat_template is None:
        raise ConfigError("data.tokenizer", str(getattr(tokenizer, "folder", "byte")),
                          "use a tokenizer whose tokenizer_config.json has a chat_template",
                          reason=f"{spec.field} is SFT (messages_field) and this tokenizer has no chat template")
    column = spec.messages_field or spec.text_field
    check_columns(table, f"{spec.field}.{'messages_field' if spec.sft else 'text_field'}", column, spec.path)

    def encode(batch: dict[str, list], rows: list[int]) -> dict[str, list]:
        if spec.sft:
            pairs = [render_conversation(tokenizer, check_messages(m, f"{spec.field} row {row}"),
                                         f"{spec.field} row {row}", ignore_index)
                     for m, row in zip(batch[column], rows, strict=True)]
            return {"input_ids": [p[0] for p in pairs], "labels": [p[1] for p in pairs]}
        for text, row in zip(batch[column], rows, strict=True):
            if not isinstance(text, str):
                raise ConfigError(f"{spec.field}.text_field", column, "give a column of strings",
                                  reason=f"row {row} holds a {type(text).__name__}")
        return {"input_ids": tokenizer.encode(batch[column])}

    from datasets import Features, Sequence, Value

    columns = {"input_ids": Sequence(Value("int32"))}
    if spec.sft:
        columns["labels"] = Sequence(Value("int32"))
    return table.map(encode, batched=True, batch_size=256, with_indices=True, remove_columns=table.column_names,
                     features=Features(columns), cache_file_name=str(out / TOKENS), load_from_cache_file=False)


def _lengths(tokens) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_value_length(tokens.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)


def _statistics(tokens, lengths: np.ndarray, windows: Windows, seq_len: int, sft: bool,
                ignore_index: int) -> dict[str, int]:
    kept = int(windows.length.sum())
    if sft:  # counted in Arrow, without the table in Python lists
        import pyarrow.compute as pc

        labels = pc.list_flatten(tokens.column("labels"))
        loss = int(pc.sum(pc.not_equal(labels, ignore_index)).as_py() or 0)
    else:
        loss = kept - len(windows.doc)  # a piece's first token is predicted by nothing
    return {"documents": int((lengths > 0).sum()), "tokens": int(lengths.sum()), "loss_tokens": int(loss),
            "pieces": len(windows.doc), "windows": len(windows), "padding_tokens": len(windows) * seq_len - kept,
            "dropped_tokens": windows.dropped_tokens}


def _build(spec: SourceSpec, tokenizer, layout: dict[str, Any], datasets_cache: Path, out: Path) -> None:
    """Tokenize and pack into ``out``; ``layout``: seq_len, packing, overflow and ignore_index."""
    seq_len, ignore_index = layout["seq_len"], layout["ignore_index"]
    table = _limit_files(load_table(spec.paths, spec.path_field, datasets_cache), spec)
    tokens = _tokenize(table, spec, tokenizer, out, ignore_index).data
    lengths = _lengths(tokens)
    if not lengths.sum():
        raise ConfigError(spec.path_field, spec.path, "give a source with text in it",
                          reason="it has no tokens")
    doc, start, length, dropped = cut_documents(lengths, seq_len, layout["overflow"], spec.field)
    windows = pack(doc, start, length, seq_len, layout["packing"], dropped)
    np.savez(out / WINDOWS, doc=windows.doc, start=windows.start, length=windows.length,
             offsets=windows.offsets, dropped=np.int64(dropped))
    stats = _statistics(tokens, lengths, windows, seq_len, spec.sft, ignore_index)
    (out / STATS).write_text(json.dumps(stats, indent=1), encoding="utf-8")


def _seal(folder: Path, key: str, identity: str) -> None:
    """Write the manifest (each file's size), then flush the files and the folder: the
    rename that follows publishes only what is on disk."""
    sizes = {name: (folder / name).stat().st_size for name in (TOKENS, WINDOWS, STATS)}
    manifest = {"format": FORMAT, "key": key, "identity": identity, "files": sizes}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    for name in (*sizes, MANIFEST):
        fsync_path(folder / name)
    fsync_path(folder)


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Damaged(f"no {MANIFEST}") from None
    except (OSError, ValueError) as error:
        raise _Damaged(f"{MANIFEST} is unreadable: {error}") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or not isinstance(manifest.get("identity"), str)
            or not isinstance(manifest.get("files"), dict) or set(manifest["files"]) != {TOKENS, WINDOWS, STATS}):
        raise _Damaged(f"{MANIFEST} is not a format-{FORMAT} manifest")
    return manifest


def _check_sizes(folder: Path, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            raise _Damaged(f"{name} is missing")
        if path.stat().st_size != size:
            raise _Damaged(f"{name} has {path.stat().st_size} bytes, not {size}")


def _open_entry(folder: Path) -> _Entry | None:
    """The entry in ``folder`` (None: there is none); ``_Damaged`` if it cannot be read."""
    if not folder.exists() and not folder.is_symlink():
        return None
    import pyarrow as pa

    manifest = _read_manifest(folder)
    _check_sizes(folder, manifest["files"])
    try:
        with np.load(folder / WINDOWS) as arrays:
            windows = Windows(arrays["doc"], arrays["start"], arrays["length"], arrays["offsets"],
                              int(arrays["dropped"]))
        stats = json.loads((folder / STATS).read_text(encoding="utf-8"))
        # datasets writes its Arrow files as IPC streams (what its own Dataset.from_file maps)
        tokens = pa.ipc.open_stream(pa.memory_map(str(folder / TOKENS))).read_all()
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, pa.ArrowException) as error:
        raise _Damaged(f"{type(error).__name__}: {error}") from None
    if not isinstance(stats, dict) or stats.get("windows") != len(windows) or (
            len(windows.doc) and int(windows.doc.max()) >= len(tokens)):
        raise _Damaged(f"{STATS}, {WINDOWS} and {TOKENS} do not describe the same data")
    return _Entry(manifest["identity"], tokens, windows, stats)


def _discard(folder: Path, damage: _Damaged) -> None:
    _log.warning(f"data cache entry {folder} is damaged ({damage}): building it again", all_ranks=True)
    try:
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
        else:
            folder.unlink()
    except OSError as error:
        raise ConfigError("data.cache_dir", str(folder), f"delete {folder} and run again",
                          reason=f"that cache entry is damaged ({damage}) and could not be removed: {error}") from None


def _sweep_partials(cache: Path, key: str) -> None:
    """Remove the ``<key>.partial.*`` folders of builds that died (a kill, a lost node): the
    caller holds the key's lock, and a live build holds it while its partial folder exists."""
    for stale in sorted(cache.glob(f"{key}.partial.*")):
        _log.info(f"removing {stale}, left by a build of this data that did not finish", all_ranks=True)
        try:
            shutil.rmtree(stale)
        except OSError as error:
            raise ConfigError("data.cache_dir", str(stale), f"delete {stale} and run again",
                              reason=f"that folder is left by a build that did not finish and could not be "
                                     f"removed: {error}") from None


@contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock = FileLock(str(path), timeout=timeout_s)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError("data.cache_lock_timeout_s", timeout_s,
                          "another process is preparing this data: wait for it, or raise data.cache_lock_timeout_s; "
                          f"if none is running, delete {path}",
                          reason=f"the lock {path} was still held after {timeout_s:g} s") from None
    try:
        yield
    finally:
        lock.release()


def _check_unchanged(spec: SourceSpec, files: list[Path], before: list[FileState]) -> None:
    if files_state(files) != before:
        raise ConfigError(spec.path_field, spec.path, "run again once its files no longer change",
                          reason="its files changed while they were being tokenized")


def _build_entry(spec: SourceSpec, tokenizer, files: list[Path], state: list[FileState], settings: dict[str, Any],
                 ignore_index: int, cache: Path) -> None:
    """Build ``cache/<key>`` from ``files`` (in ``state``, the key's) in a partial folder, seal
    it and rename it; the partial folder never outlives a failure."""
    key = cache_key(settings, state)
    # datasets finds its own Arrow copy of the files by their names and mtimes alone: one
    # folder per state of the files keeps a rewritten file from being read from a stale copy.
    datasets_cache = cache / "datasets" / _digest({"files": state})
    partial = cache / f"{key}.partial.{os.getpid()}"
    partial.mkdir()
    try:
        identity = _digest({**settings, "content": content_digest(files)})
        _build(spec, tokenizer, {**settings, "ignore_index": ignore_index}, datasets_cache, partial)
        _check_unchanged(spec, files, state)
        _seal(partial, key, identity)
        os.replace(partial, cache / key)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # the error itself goes on up
        raise
    fsync_path(cache)


def prepare_source(spec: SourceSpec, tokenizer, *, seq_len: int, packing: bool, overflow: str,
                   cache_dir: str | Path, lock_timeout_s: float = 3600.0,
                   ignore_index: int = IGNORE_INDEX) -> PreparedSource:
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    files = resolve_files(spec.paths, spec.path_field)
    settings = _settings(spec, tokenizer, seq_len, packing, overflow, ignore_index)
    state = files_state(files)
    key = cache_key(settings, state)
    final = cache / key
    built = False
    with _locked(cache / f"{key}.lock", lock_timeout_s):
        _sweep_partials(cache, key)
        try:
            entry = _open_entry(final)
        except _Damaged as damage:
            _discard(final, damage)
            entry = None
        if entry is None:
            built = True
            _build_entry(spec, tokenizer, files, state, settings, ignore_index, cache)
            try:
                entry = _open_entry(final)
            except _Damaged as damage:
                raise ConfigError("data.cache_dir", str(final), f"delete {final}, check the disk it is on, and run "
                                  "again", reason=f"that cache entry is unreadable right after it was built: "
                                  f"{damage}") from None
    return PreparedSource(spec, key, entry.identity, entry.tokens, entry.windows, entry.stats, built)
