"""A source's files, read with HF ``datasets`` into a memory-mapped Arrow table.

``path`` is a glob of files of one format, a ``datasets`` ``save_to_disk`` folder, or a
folder of such files. ``.txt`` files are one document each (field ``text``); the
others are tables with one document per row. Every problem is a ``ConfigError`` naming the
source's field: no file, mixed formats, a corrupt jsonl line (by file and line), a missing
column, an empty source.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from pathlib import Path

from fsdp_turbo.core.errors import ConfigError

STDLIB = "stdlib:"
# suffix -> the datasets builder that reads it
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
            ".py": "text", ".md": "text", ".arrow": "arrow"}


def _expand(pattern: str) -> str:
    if pattern.startswith(STDLIB):
        return str(Path(sysconfig.get_paths()["stdlib"]) / pattern[len(STDLIB):])
    return pattern


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def saved_dataset(patterns: tuple[str, ...]) -> Path | None:
    """The ``save_to_disk`` folder a source names, if it names one."""
    path = Path(_expand(patterns[0]))
    return path if len(patterns) == 1 and is_saved_dataset(path) else None


def _matches(pattern: str) -> list[Path]:
    path = Path(_expand(pattern))
    if path.is_dir():  # a folder: its data files
        return [p for p in path.iterdir() if p.is_file() and p.suffix.lower() in BUILDERS]
    return [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]


def resolve_files(patterns: tuple[str, ...], field: str) -> list[Path]:
    """The files a source names, sorted (the same order on every rank and every run)."""
    folder = saved_dataset(patterns)
    if folder is not None:
        return sorted(p for p in folder.rglob("*") if p.is_file())
    files = sorted({f for pattern in patterns for f in _matches(pattern)})
    pattern = patterns[0] if len(patterns) == 1 else list(patterns)
    if not files:
        raise ConfigError(field, pattern, "give a glob that matches local data files, or a save_to_disk folder",
                          reason="no file matches")
    kinds = {f.suffix.lower() for f in files}
    unknown = sorted(kinds - set(BUILDERS))
    if unknown:
        raise ConfigError(field, pattern, f"use files ending in one of {sorted(BUILDERS)}",
                          reason=f"{unknown[0]} is not a data format")
    if len({BUILDERS[k] for k in kinds}) > 1:
        raise ConfigError(field, pattern, "give one format per source (add a source for each)",
                          reason=f"the glob mixes {sorted(kinds)}")
    return files


def _corrupt_line(files: list[Path]) -> tuple[Path, int, str] | None:
    """The first jsonl line that is not a JSON object: (file, 1-based line, the error)."""
    for path in files:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    return path, number, f"{error.msg} (character {error.pos + 1} of the line)"
                if not isinstance(row, dict):
                    return path, number, f"a {type(row).__name__}, not an object"
    return None


def load_table(patterns: tuple[str, ...], field: str, datasets_cache: Path):
    """The source's rows as a ``datasets.Dataset`` (memory-mapped Arrow). ``datasets`` keeps its
    own Arrow copy of the files in ``datasets_cache``, found again by their names and mtimes
    only: the caller gives a folder per state of the files (see ``prepare``)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    folder = saved_dataset(patterns)
    if folder is not None:
        return datasets.load_from_disk(str(folder))
    files = resolve_files(patterns, field)
    pattern = patterns[0] if len(patterns) == 1 else list(patterns)
    if not any(f.stat().st_size for f in files):
        raise ConfigError(field, pattern, "give a source with documents", reason="its files are empty")
    builder = BUILDERS[files[0].suffix.lower()]
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(datasets_cache), **options)
    except datasets.exceptions.DatasetGenerationError as error:
        bad = _corrupt_line(files) if files[0].suffix.lower() == ".jsonl" else None
        if bad is None:
            raise ConfigError(field, pattern, "check that the files are valid " + builder,
                              reason=str(error.__cause__ or error)) from error
        file, line, why = bad
        raise ConfigError(field, f"{file}:{line}", "fix or remove that line", reason=f"not JSON: {why}") from None


def check_columns(table, source_field: str, column: str, pattern: str) -> None:
    if column not in table.column_names:
        raise ConfigError(source_field, column, f"use one of the columns {sorted(table.column_names)}",
                          reason=f"{pattern} has no such column")
    if len(table) == 0:
        raise ConfigError(source_field.rsplit(".", 1)[0] + ".path", pattern, "give a source with documents",
                          reason="it is empty")
