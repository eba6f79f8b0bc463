"""The job as the launcher resolved it: read and checked once, handed to the workers.

``fsdp-turbo train`` reads the job file, applies the command-line overrides
(``--max-steps``, ``--output-dir``, ``--save-every``) and checks the result, then writes it
(``JobConfig.to_dict()`` as JSON) to one file and names that file in the workers'
environment (``FSDP_TURBO_RESOLVED_JOB``, inherited through torchrun). Every worker builds
its job from that file (``JobConfig.from_dict``) and applies no override itself, so all of
them, and every restart, run exactly the job the launcher checked, even when the job file
is edited while the job runs.

Where the file lives: in a temporary folder of the launcher's own, one per launch and so
one per node, removed when torchrun returns. Each node's launcher resolves the job for its
own workers, whether or not ``output_dir`` is shared between nodes: a name in a shared
folder would have to be unique per launcher (two nodes can be one host), and a folder that
is not shared would gain nothing. The launcher outlives its workers and their restarts, so
the file is there whenever a worker starts; a machine crash takes launcher and workers
alike, so the file is not flushed to disk, only renamed into place whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.core.errors import ConfigError

VARIABLE = "FSDP_TURBO_RESOLVED_JOB"
NAME = "job.resolved.json"
FORMAT = 1  # bump when the file's layout changes


def _source(path: str | Path) -> str:
    """The job file, as an absolute path: what a worker's own argument is checked against."""
    return str(Path(path).expanduser().resolve())


def resolve_job(path: str | Path, *, max_steps: int | None = None, output_dir: str | None = None,
                save_every: int | None = None) -> JobConfig:
    """The job file at ``path`` with the command-line overrides applied, checked."""
    return JobConfig.from_file(path).with_overrides(max_steps=max_steps, output_dir=output_dir,
                                                     save_every=save_every)


def _encode(job: JobConfig, source: str | Path) -> str:
    document = {"format": FORMAT, "source": _source(source), "job": job.to_dict()}
    try:
        return json.dumps(document, indent=1, allow_nan=False)
    except (TypeError, ValueError) as error:  # a YAML/TOML date or the like in model.config
        raise ConfigError("model.config", str(source), "use only text, numbers, booleans, null, lists and mappings "
                          "as values in the job file", reason=f"the job cannot be handed to the workers: {error}") \
            from None


def write_resolved(job: JobConfig, source: str | Path, folder: str | Path) -> Path:
    """Write ``job`` (resolved from the job file ``source``) into ``folder``; its path."""
    folder = Path(folder)
    target, partial = folder / NAME, folder / f"{NAME}.partial"
    partial.write_text(_encode(job, source), encoding="utf-8")
    os.replace(partial, target)  # a worker never reads half a file
    return target


def _read(path: Path) -> dict[str, Any]:
    fix = f"start the workers through `fsdp-turbo train`, or unset {VARIABLE}"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(VARIABLE, str(path), fix, reason="there is no such file") from None
    except (OSError, ValueError) as error:
        raise ConfigError(VARIABLE, str(path), fix, reason=f"it cannot be read: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or not isinstance(document.get("job"), dict):
        raise ConfigError(VARIABLE, str(path), "run the launcher and the workers from the same fsdp-turbo install",
                          reason=f"the file is not a format-{FORMAT} resolved job")
    return document


def read_resolved(path: str | Path, source: str | Path) -> JobConfig:
    """The job the launcher resolved from ``source`` and wrote to ``path``."""
    document = _read(Path(path))
    if document.get("source") != _source(source):
        raise ConfigError(VARIABLE, str(path), f"start the workers through `fsdp-turbo train`, or unset {VARIABLE}",
                          reason=f"it was resolved from {document.get('source')}, not from {_source(source)}")
    return JobConfig.from_dict(document["job"])


def load_job(source: str | Path) -> JobConfig:
    """A worker's job: the launcher's resolved file where ``FSDP_TURBO_RESOLVED_JOB`` names
    one; else (a worker started by torchrun directly) the job file as it stands."""
    path = os.environ.get(VARIABLE)
    return read_resolved(path, source) if path else JobConfig.from_file(source)
