"""Checkpoints with ``torch.distributed.checkpoint``: each belongs to a run, is written
atomically, and is read back as data only.

``OUTPUT/checkpoints/RUN/step-N/`` holds the model and optimizer (DCP, sharded,
reshardable to another world size or layout), each rank's RNG states (tensors only,
loaded with ``weights_only``) and ``meta.json`` (run, step, scheduler, data position).

- **Runs.** A run is one training timeline: a fresh start gets a new id
  (``run-YYYYMMDD-HHMMSS-xxxxxx``, UTC), and a resume from the newest checkpoint of a run
  continues that run. A resume from an older checkpoint starts a new run, so its saves
  never replace the checkpoints of the timeline it branched from. Retention (``keep``)
  only ever deletes this run's own older checkpoints.
- **Atomic.** Every rank writes into ``step-N.partial/``; only when all have finished does
  rank 0 add ``meta.json``, flush everything to disk and rename the folder. A crash
  mid-save leaves a ``.partial`` folder that resume ignores. A folder being replaced is
  moved aside first and deleted only once the new one is in place.
- **In the background** (``checkpoint.async_save``): a save returns once each rank has copied
  its shards to host memory, and is written while training goes on, at most one at a time
  (``fsdp_turbo.checkpoint.training``). Retention runs once the new checkpoint is complete, so
  it never deletes one still being written; the job waits for the last save before it ends.
- **Data, never code.** DCP's metadata and non-tensor values are read through
  ``fsdp_turbo.checkpoint.safe_dcp`` (an allow-list, ``weights_only``); ``meta.json`` is JSON.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_turbo.checkpoint import training
from fsdp_turbo.checkpoint.training import (
    META,
    TrainingCheckpointer,
    read_trainable_state,
)
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.device import get_rng_state, set_rng_state
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.logging import get_logger

_log = get_logger(__name__)
_STEP = re.compile(r"^step-(\d+)$")
# A run id names a folder under OUTPUT/checkpoints: one plain name (what new_run_id makes, or an
# older version's), never a path. It is read back from meta.json, which is data from disk.
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHECKPOINTS = "checkpoints"
__all__ = ["CHECKPOINTS", "META", "Resume", "Saved", "complete_checkpoints", "load_checkpoint", "new_run_id",
           "read_meta", "read_trainable_state", "resolve_resume", "save_checkpoint"]


@dataclass(frozen=True)
class Saved:
    """One complete checkpoint."""

    path: Path
    run: str  # the run that wrote it ("legacy" for a flat checkpoints/step-N of older versions)
    step: int
    saved_at: float  # seconds since the epoch, from meta.json


def new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def read_meta(folder: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint folder (JSON: data only), with its step."""
    meta = training.read_meta(folder)
    try:
        int(meta["step"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(META, str(folder / META), f"delete {folder} (or move it away) and resume from another "
                              "checkpoint", reason=f"it names no step ({type(error).__name__}: {error})") from None
    return meta


def _run_name(meta: dict[str, Any], folder: Path, default: str) -> str:
    """The run a checkpoint belongs to, from its ``meta.json``: one plain folder name. A resumed
    run saves under ``OUTPUT/checkpoints/RUN``, so a name such as ``../..`` or ``/etc`` would
    send its writes and deletes outside the output folder."""
    run = meta.get("run", default)
    if not isinstance(run, str) or not _RUN_NAME.match(run) or _STEP.match(run) or set(run) == {"."}:
        raise CheckpointError(f"{META} run", run, f"delete {folder} (or move it away), or set its \"run\" "
                              "to one plain folder name (letters, digits, '.', '_', '-'), such as the name of "
                              "the folder it is in", reason="a run is a folder under OUTPUT/checkpoints, never "
                              "a path")
    return run


def _saved(path: Path, run: str) -> Saved | None:
    match = _STEP.match(path.name)
    if not match or not (path / META).is_file():
        return None
    meta = read_meta(path)
    return Saved(path, _run_name(meta, path, run), int(match.group(1)), float(meta.get("saved_at", 0.0)))


def complete_checkpoints(output_dir: str | Path) -> list[Saved]:
    """Every complete checkpoint in the folder, of every run, oldest save first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [_saved(path, "legacy") for path in root.glob("step-*")]  # older versions' flat layout
    found += [_saved(path, run.name) for run in root.iterdir() if run.is_dir() and not _STEP.match(run.name)
              for path in run.glob("step-*")]
    return sorted((s for s in found if s is not None), key=lambda s: (s.saved_at, s.step))


@dataclass(frozen=True)
class Resume:
    """Where a run starts: a checkpoint (or none) and the run id it saves under."""

    checkpoint: Path | None
    run: str
    note: str  # one line for the log: what was chosen, and why


def resolve_resume(resume: str, output_dir: str | Path, fresh_run: str) -> Resume:
    """``auto``: the newest checkpoint in the folder (the last one saved, of any run);
    ``none``; or a checkpoint folder. ``fresh_run`` is the id a new run gets (made once,
    on rank 0, so that every rank uses the same)."""
    saved = complete_checkpoints(output_dir)
    if resume == "none" or (resume == "auto" and not saved):
        runs = sorted({s.run for s in saved})
        note = f"run {fresh_run}: a fresh start"
        if runs:
            note += (f"; {Path(output_dir) / CHECKPOINTS} holds {len(saved)} checkpoint(s) of {len(runs)} other "
                     f"run(s) ({', '.join(runs[-3:])}), kept as they are")
        return Resume(None, fresh_run, note)
    if resume == "auto":
        chosen = saved[-1]
        note = f"from {chosen.path} (the newest of {len(saved)} checkpoint(s) here)"
    else:
        path = Path(resume)
        chosen = _saved(path, "legacy") if path.is_dir() else None
        if chosen is None:
            raise CheckpointError("--resume", resume, "give a checkpoint folder (OUTPUT/checkpoints/RUN/step-N), "
                                  "auto or none", reason=f"not a complete checkpoint (no step-N folder with {META})")
        note = f"from {chosen.path}"
    own = [s for s in saved if s.run == chosen.run]
    if own and max(s.step for s in own) > chosen.step:  # a branch: its saves must not replace the others
        return Resume(chosen.path, fresh_run, f"run {fresh_run}: resumed {note}, an older checkpoint of run "
                      f"{chosen.run}, so a new run")
    return Resume(chosen.path, chosen.run, f"run {chosen.run}: resumed {note}")


def _retire(output_dir: Path, run: str, keep: int) -> None:
    """Delete this run's checkpoints beyond the newest ``keep``; never another run's."""
    own = sorted((s for s in complete_checkpoints(output_dir) if s.run == run), key=lambda s: s.step)
    for old in own[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)


def save_checkpoint(saver: TrainingCheckpointer, output_dir: str | Path, run: str, step: int,
                    model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], keep: int,
                    crash_after_shards: bool = False) -> Path:
    """Every rank calls this; returns the final folder, complete on return, or once ``saver``'s
    background write is done (``checkpoint.async_save``). ``crash_after_shards``: fault
    injection (``cli.faults``), exit once the shards are written, before the rename."""
    folder = Path(output_dir) / CHECKPOINTS / run / f"step-{step}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    device_type = saver.device.type

    def rng_states(partial: Path) -> None:
        torch.save(get_rng_state(device_type), partial / f"rng-rank{rank}.pt")

    def crash() -> None:
        _log.warning(f"fault injection: exiting mid-save of step {step}", all_ranks=True)
        os._exit(17)

    saver.save(folder, model, optimizer, {"run": run, "step": step, "saved_at": time.time(), **extra},
               rank_files=rng_states, before_complete=crash if crash_after_shards else None,
               on_complete=lambda _: _retire(Path(output_dir), run, keep))
    return folder


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG states; return ``meta.json``."""
    with every_rank_or_none("load_checkpoint", device):
        meta = read_meta(path)
    read_trainable_state(path, model, optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = path / f"rng-rank{rank}.pt"
    with every_rank_or_none("load_checkpoint", device):
        if rng.is_file():
            set_rng_state(_rng_states(rng), device.type)
        elif rank < int(meta.get("world_size", 0)):  # absent only for ranks the saving job did not have
            raise CheckpointError(rng.name, str(rng), "copy the checkpoint folder again, whole",
                                  reason=f"the checkpoint was saved by {meta['world_size']} ranks, and rank "
                                  f"{rank}'s RNG states are missing")
    return meta


def _rng_states(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        raise CheckpointError(path.name, str(path), "delete it (this rank then starts from a fresh RNG) or copy the "
                              "checkpoint again", reason=f"it cannot be read as RNG states ({error})") from None
