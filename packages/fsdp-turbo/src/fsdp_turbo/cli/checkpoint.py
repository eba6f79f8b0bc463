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
- **Data, never code.** DCP's metadata and non-tensor values are read through
  ``fsdp_turbo.checkpoint.safe_dcp`` (an allow-list, ``weights_only``); ``meta.json`` is JSON.
"""

from __future__ import annotations

import json
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdp_turbo.checkpoint import safe_dcp
from fsdp_turbo.checkpoint.atomic import fsync_tree, move_into_place
from fsdp_turbo.checkpoint.strided import for_dcp, from_dcp
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.device import get_rng_state, set_rng_state
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.logging import get_logger

_log = get_logger(__name__)
_STEP = re.compile(r"^step-(\d+)$")
# A run id names a folder under OUTPUT/checkpoints: one plain name (what new_run_id makes, or an
# older version's), never a path. It is read back from meta.json, which is data from disk.
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
META = "meta.json"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class Saved:
    """One complete checkpoint."""

    path: Path
    run: str  # the run that wrote it ("legacy" for a flat checkpoints/step-N of older versions)
    step: int
    saved_at: float  # seconds since the epoch, from meta.json


# Frozen parameters (a LoRA model's base) never change: the job's source holds them, so
# checkpoints are the trainable parameters and their optimizer state only.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)


def new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def read_meta(folder: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint folder (JSON: data only)."""
    path = folder / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(META, str(path), f"delete {folder} (or move it away) and resume from another "
                              "checkpoint", reason=f"it cannot be read as this project's checkpoint "
                              f"metadata ({type(error).__name__}: {error})") from None
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


def write_trainable_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP-save the trainable parameters and their optimizer state into ``folder``, sharded: each
    rank writes its own shards. Every rank calls this."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    dcp.save(for_dcp({"model": model_state, "optimizer": optimizer_state}), checkpoint_id=str(folder))


def read_trainable_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load what :func:`write_trainable_state` wrote, at this job's layout (DCP reshards), as data
    only (``safe_dcp``); without ``optimizer``, the parameters alone. Every rank calls this."""
    if optimizer is None:
        model_state = get_model_state_dict(model, options=TRAINABLE_ONLY)
        original = {"model": model_state}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
        original = {"model": model_state, "optimizer": optimizer_state}
    state = for_dcp(original)  # LoRA experts' strided shards as plain-sharded views (checkpoint.strided)
    safe_dcp.load(state, Path(folder))
    state = from_dcp(state, original)
    # not strict: the frozen parameters are absent by design (safe_dcp.load has already
    # refused a checkpoint lacking any trainable one)
    loose = StateDictOptions(ignore_frozen_params=True, strict=False)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=loose)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=loose)


def save_checkpoint(output_dir: str | Path, run: str, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, extra: dict[str, Any], keep: int,
                    device: torch.device, crash_after_shards: bool = False) -> Path:
    """Every rank calls this; returns the final folder. ``crash_after_shards``: fault
    injection (``cli.faults``), exit once the shards are written, before the rename."""
    folder = Path(output_dir) / CHECKPOINTS / run
    final, partial = folder / f"step-{step}", folder / f"step-{step}.partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    with every_rank_or_none("save_checkpoint", device):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash
            partial.mkdir(parents=True)
    write_trainable_state(partial, model, optimizer)
    with every_rank_or_none("save_checkpoint", device):
        torch.save(get_rng_state(device.type), partial / f"rng-rank{rank}.pt")
    if crash_after_shards:
        _log.warning(f"fault injection: exiting mid-save of step {step}", all_ranks=True)
        os._exit(17)
    with every_rank_or_none("save_checkpoint", device):
        if rank == 0:
            meta = {"run": run, "step": step, "saved_at": time.time(), **extra}
            (partial / META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
            fsync_tree(partial)  # every rank's files and the folder itself are on disk before the rename
            move_into_place(partial, final)
            _retire(Path(output_dir), run, keep)
    return final


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
