"""Preemption: a cluster's notice that it is about to stop the job (``run.preemption_signals``).

Kubernetes sends SIGTERM to a pod's first process, then SIGKILL once the grace period ends;
Slurm sends what ``--signal`` names to the job step's processes (the agents and, through their
cgroup, the workers). Either way the job keeps everything trained up to the notice:

- **The launcher** (``fsdp-turbo train``, which hosts torchrun's agent) takes these signals from
  torchrun's agent (which would otherwise kill the workers at once) and passes each on to its
  workers; it then waits for them as for any run.
- **Every worker** notes the signal, and after each step the ranks agree (one small all-reduce
  of a flag) on whether any of them got one. At the first step they agree on, every rank saves a
  checkpoint of that step (unless the step just saved one), waits for it to be complete, and
  ends cleanly; rank 0 writes ``OUTPUT/preempted.json`` (the step and the signal), which the
  next launch clears.
- **The launcher** then exits with ``PREEMPTED_EXIT`` (75, sysexits' "temporary failure: try
  again"), which the Slurm and Kubernetes recipes turn into a requeue or a restart; the next run
  resumes with ``--resume auto`` from that checkpoint and repeats what an uninterrupted run does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from fsdp_turbo.core.logging import get_logger

_log = get_logger(__name__)
PREEMPTED_EXIT = 75
MARKER = "preempted.json"
# torchrun's agent turns these signals into "kill the workers and exit" (its default list)
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class _Notice:
    """The preemption signals this process takes: ``_on`` runs in the main thread for each one
    received (after noting its name); ``close`` puts the previous handlers back."""

    def __init__(self, signals: tuple[str, ...], where: str) -> None:
        self.received: str | None = None
        self._previous = {}
        if signals and not _can_handle_signals(f"run.preemption_signals in {where}"):
            return
        for name in signals:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._take)

    def _take(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self._on(signum)

    def _on(self, signum: int) -> None:
        """What else this process does with a signal it took."""

    def close(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)


class WorkerNotice(_Notice):
    """In a worker: which preemption signal this process got, if any (noted by a handler, read
    between steps)."""

    def __init__(self, signals: tuple[str, ...]) -> None:
        super().__init__(signals, "this worker")

    def agreed(self, device: torch.device) -> str | None:
        """Collective: the signal, when any rank has got one (``"a peer's signal"`` on ranks that
        have not), else ``None``. Every rank calls it after every step."""
        flag = torch.tensor([0 if self.received is None else 1], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        return self.received or "a peer's signal"


def _can_handle_signals(what: str) -> bool:
    """Python runs signal handlers in the main thread only, and only it may install them."""
    if threading.current_thread() is threading.main_thread():
        return True
    _log.warning(f"{what}: not watched, as training runs outside the main thread (only it may take signals)")
    return False


def mark(output_dir: str | Path, step: int, why: str, run: str) -> None:
    """Rank 0: the launcher's note that this launch ended preempted."""
    record = {"step": step, "signal": why, "run": run}
    (Path(output_dir) / MARKER).write_text(json.dumps(record), encoding="utf-8")


def read_mark(output_dir: str | Path) -> dict[str, Any] | None:
    """The launcher, after its workers ended: the note, if this launch was preempted. It stays (a
    batch script may read it, as the Slurm recipe does) until the next launch clears it."""
    path = Path(output_dir) / MARKER
    if not path.is_file():
        return None
    with contextlib.suppress(ValueError, OSError):
        record = json.loads(path.read_text(encoding="utf-8"))
        return record if isinstance(record, dict) else {}
    return {}


def clear_mark(output_dir: str | Path) -> None:
    """The launcher, before it starts workers: a note left by an earlier launch is not this one's."""
    with contextlib.suppress(FileNotFoundError):
        (Path(output_dir) / MARKER).unlink()


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def _workers() -> list[int]:
    """torchrun's workers: the agent runs in this process and forks them from its forkserver
    (``cli.main.run_agent``), so they are this process's grandchildren. Its children (the
    forkserver, multiprocessing's resource tracker) and the workers' own children are not."""
    return [pid for child in _children(os.getpid()) for pid in _children(child)]


class LauncherNotice(_Notice):
    """In the launcher: the preemption signals are passed on to the workers (and noted), instead
    of reaching torchrun's agent, which is told to handle only the others
    (``torchrun_signals``, its ``--signals-to-handle``). Made before torchrun starts; ``close``
    puts the handlers back."""

    def __init__(self, signals: tuple[str, ...]) -> None:
        self.torchrun_signals = ",".join(name for name in _TORCHRUN_SIGNALS if name not in signals)
        super().__init__(signals, "the launcher")

    def _on(self, signum: int) -> None:
        for pid in _workers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
