"""Processes seen through /proc (Linux): a launcher's tree of agents and workers, their states and
the signals waiting for them, for the tests that stop, signal or kill them."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state: 'R', 'S', 'T' for stopped, ...) of every process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]  # after the command
            found[int(stat.parent.name)] = (int(parent), state)
    return found


def tree(pid: int) -> dict[int, str]:
    """pid -> state of ``pid`` and all its descendants. torchrun starts each worker in a
    session of its own, so a node is its agent's process tree, not its process group."""
    every, found, frontier = processes(), {}, [pid]
    while frontier:
        current = frontier.pop()
        if current in every:
            found[current] = every[current][1]
            frontier += [child for child, (parent, _) in every.items() if parent == current]
    return found


def pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits to be delivered to ``pid`` (a stopped process takes it once continued)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    mask = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(mask & (1 << (signum - 1)))


def wait_for(condition, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.1)
