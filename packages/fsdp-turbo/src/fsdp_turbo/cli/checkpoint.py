"""Checkpoints with ``torch.distributed.checkpoint``: written atomically, resumed by default.

``OUTPUT/checkpoints/step-N/`` holds the model and optimizer (DCP, sharded, reshardable to
another world size or layout), each rank's RNG state (tensors only, loaded with
``weights_only``) and ``meta.json`` (step, scheduler, data position). Every rank writes into
``step-N.partial/``; only when all have finished does rank 0 add ``meta.json`` and rename
the folder. A crash mid-save leaves a ``.partial`` folder that resume ignores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_turbo.core.logging import get_logger

_log = get_logger(__name__)
_STEP = re.compile(r"^step-(\d+)$")
META = "meta.json"
# A test hook, not a setting: exit this process after its shards are written, before the rename.
CRASH_DURING_SAVE_ENV = "FSDP_TURBO_TEST_HOOK_CRASH_DURING_SAVE_AT_STEP"


def fsync_tree(folder: Path, *, files: bool = True) -> None:
    """Flush ``folder``'s files (all of them, whoever wrote them) and the folder's own entry list."""
    if files:
        for path in folder.rglob("*"):
            if path.is_file():
                with path.open("rb") as handle:
                    os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    root = Path(output_dir) / "checkpoints"
    found = []
    for path in root.glob("step-*") if root.is_dir() else ():
        match = _STEP.match(path.name)
        if match and (path / META).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """``auto``: the latest complete checkpoint (or none); ``none``; or a folder."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / META).is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {META})")
    return path


def save_checkpoint(output_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], keep: int) -> Path:
    """Every rank calls this; returns the final folder."""
    root = Path(output_dir) / "checkpoints"
    final, partial = root / f"step-{step}", root / f"step-{step}.partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash
        partial.mkdir(parents=True)
    _barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(partial))
    torch.save({"cpu_rng": torch.get_rng_state()}, partial / f"rng-rank{rank}.pt")
    _barrier()
    if os.environ.get(CRASH_DURING_SAVE_ENV) == str(step):
        _log.warning(f"{CRASH_DURING_SAVE_ENV}={step}: exiting mid-save (fault injection)")
        os._exit(17)
    if rank == 0:
        (partial / META).write_text(json.dumps({"step": step, **extra}, indent=1), encoding="utf-8")
        fsync_tree(partial)  # every rank's files and the folder itself are on disk before the rename
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        fsync_tree(final.parent, files=False)
        for _, old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG; return ``meta.json`` (step, scheduler, data)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = path / f"rng-rank{rank}.pt"
    if rng.is_file():  # absent when resuming at a larger world size
        torch.set_rng_state(torch.load(rng, weights_only=True)["cpu_rng"])
    return json.loads((path / META).read_text(encoding="utf-8"))
