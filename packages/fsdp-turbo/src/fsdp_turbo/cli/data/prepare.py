"""Tokenize and pack each source once, and keep the result in a cache.

The cache key is a digest of everything the result depends on: the tokenizer's files,
the source's files (names, sizes, modification times) and fields, ``seq_len``,
``packing``, ``overflow`` and ``max_bytes``. ``CACHE/<key>/`` holds the tokens (an Arrow
file, memory-mapped when read), the windows (``windows.npz``) and ``stats.json``; it is
written into ``<key>.partial`` and renamed, so it is never seen half-written.

Every rank of every node calls ``prepare_source`` before any process group exists. A file
lock makes one process per cache folder do the work while the others wait for it; they
then find the cache. A bad source fails in the process that holds the lock, and then
again, identically, in each of the others, so every rank reports the same error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_turbo.cli.data.chat import check_messages, render_conversation
from fsdp_turbo.cli.data.packing import Windows, cut_documents, pack
from fsdp_turbo.cli.data.sources import check_columns, load_table, resolve_files
from fsdp_turbo.core.errors import ConfigError

FORMAT = 1  # bump when the cached layout changes
TOKENS = "tokens.arrow"


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
    key: str
    tokens: Any  # datasets.Dataset: input_ids (and labels for SFT), memory-mapped
    windows: Windows
    stats: dict[str, int]
    built: bool  # this process tokenized it (False: it found the cache)



def _files_state(spec: SourceSpec) -> list[tuple[str, int, int]]:
    files = resolve_files(spec.paths, spec.path_field)
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def cache_key(spec: SourceSpec, tokenizer, seq_len: int, packing: bool, overflow: str) -> str:
    described = {"format": FORMAT, "tokenizer": tokenizer.fingerprint, "files": _files_state(spec),
                 "text_field": spec.text_field, "messages_field": spec.messages_field, "max_bytes": spec.max_bytes,
                 "seq_len": seq_len, "packing": packing, "overflow": overflow}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


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


def _tokenize(table, spec: SourceSpec, tokenizer, out: Path):
    if spec.sft and tokenizer.chat_template is None:
        raise ConfigError("data.tokenizer", str(getattr(tokenizer, "folder", "byte")),
                          "use a tokenizer whose tokenizer_config.json has a chat_template",
                          reason=f"{spec.field} is SFT (messages_field) and this tokenizer has no chat template")
    column = spec.messages_field or spec.text_field
    check_columns(table, f"{spec.field}.{'messages_field' if spec.sft else 'text_field'}", column, spec.path)

    def encode(batch: dict[str, list], rows: list[int]) -> dict[str, list]:
        if spec.sft:
            pairs = [render_conversation(tokenizer, check_messages(m, f"{spec.field} row {row}"),
                                         f"{spec.field} row {row}") for m, row in zip(batch[column], rows, strict=True)]
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

    return pc.list_value_length(tokens.data.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)


def _statistics(tokens, lengths: np.ndarray, windows: Windows, seq_len: int, sft: bool) -> dict[str, int]:
    kept = int(windows.length.sum())
    if sft:  # counted in Arrow, without the table in Python lists
        import pyarrow.compute as pc

        labels = pc.list_flatten(tokens.data.column("labels"))
        loss = int(pc.sum(pc.not_equal(labels, -100)).as_py() or 0)
    else:
        loss = kept - len(windows.doc)  # a piece's first token is predicted by nothing
    return {"documents": int((lengths > 0).sum()), "tokens": int(lengths.sum()), "loss_tokens": int(loss),
            "pieces": len(windows.doc), "windows": len(windows), "padding_tokens": len(windows) * seq_len - kept,
            "dropped_tokens": windows.dropped_tokens}


def _build(spec: SourceSpec, tokenizer, seq_len: int, packing: bool, overflow: str, cache: Path, out: Path) -> None:
    table = _limit_files(load_table(spec.paths, spec.path_field, cache), spec)
    tokens = _tokenize(table, spec, tokenizer, out)
    lengths = _lengths(tokens)
    if not lengths.sum():
        raise ConfigError(spec.path_field, spec.path, "give a source with text in it",
                          reason="it has no tokens")
    doc, start, length, dropped = cut_documents(lengths, seq_len, overflow, spec.field)
    windows = pack(doc, start, length, seq_len, packing, dropped)
    np.savez(out / "windows.npz", doc=windows.doc, start=windows.start, length=windows.length,
             offsets=windows.offsets, dropped=np.int64(dropped))
    stats = _statistics(tokens, lengths, windows, seq_len, spec.sft)
    (out / "stats.json").write_text(json.dumps(stats, indent=1), encoding="utf-8")


def _load(folder: Path) -> tuple[Any, Windows, dict[str, int]]:
    from datasets import Dataset

    arrays = np.load(folder / "windows.npz")
    windows = Windows(arrays["doc"], arrays["start"], arrays["length"], arrays["offsets"], int(arrays["dropped"]))
    stats = json.loads((folder / "stats.json").read_text(encoding="utf-8"))
    return Dataset.from_file(str(folder / TOKENS)), windows, stats


def prepare_source(spec: SourceSpec, tokenizer, *, seq_len: int, packing: bool, overflow: str,
                   cache_dir: str | Path) -> PreparedSource:
    from filelock import FileLock

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    key = cache_key(spec, tokenizer, seq_len, packing, overflow)
    final = cache / key
    built = False
    with FileLock(str(cache / f"{key}.lock")):
        if not (final / "stats.json").is_file():
            built = True
            partial = cache / f"{key}.partial.{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            try:
                _build(spec, tokenizer, seq_len, packing, overflow, cache, partial)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)  # the error itself goes on up
                raise
            os.replace(partial, final)
    tokens, windows, stats = _load(final)
    return PreparedSource(spec, key, tokens, windows, stats, built)
