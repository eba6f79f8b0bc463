"""Fault injection for the command's own tests: armed once at start-up, from one variable.

    FSDP_TURBO_FAULTS="kill@5:1,nan@3"

=================  ====================================================================
``kill@STEP:RANK``   SIGKILL that rank after step STEP (a crash)
``stop@STEP:RANK``   SIGSTOP that rank after step STEP (a peer that stops responding)
``raise@STEP:RANK``  that rank raises ``InjectedFault`` after step STEP, outside any
                     all-ranks agreement (as one rank's out-of-memory error would)
``nan@STEP``         that step's loss is NaN on every rank (the non-finite guards)
``crash_save@STEP``  every rank exits once its shards of step STEP are written, before
                     the checkpoint is renamed into place (an interrupted save)
=================  ====================================================================

``RANK`` is a global rank, or ``*`` for every worker that has the variable (one node's,
when only that node's agent was started with it). Faults fire on a job's first attempt
only: a torchrun restart runs clean. The variable is read and checked once, before any
process group; a malformed value is a ``ConfigError`` on every rank.

The training loop calls three hook points and never asks whether faults are armed:
``on_loss(step, loss)`` (a micro-batch's loss, before backward), ``after_step(step, rank)``
and ``save_options(step)`` (extra arguments of ``save_checkpoint``). ``hooks()`` gives the
armed ``Faults``, or ``NO_FAULTS``, whose hooks do nothing, when the variable is unset or
the attempt is a restart (``arm`` then returns ``None``).
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fsdp_turbo.core.errors import ConfigError

VARIABLE = "FSDP_TURBO_FAULTS"
FORMAT = ("comma-separated kill@STEP:RANK, stop@STEP:RANK, raise@STEP:RANK, nan@STEP or crash_save@STEP "
          "(RANK: a number or *)")
_ENTRY = re.compile(r"^(?P<kind>kill|stop|raise|nan|crash_save)@(?P<step>\d+)(?::(?P<rank>\d+|\*))?$")
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_PER_RANK = {*_SIGNALS, "raise"}  # the faults that name a rank


class InjectedFault(RuntimeError):
    """The error ``raise@STEP:RANK`` raises."""


@dataclass(frozen=True)
class Fault:
    kind: str  # kill, stop, nan, crash_save
    step: int
    rank: str | None  # "3", "*", or None for faults of every rank (nan, crash_save)

    def hits(self, step: int, rank: int) -> bool:
        return step == self.step and self.rank in (None, "*", str(rank))


class Hooks(Protocol):
    """The points where the training loop lets a fault in."""

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss of ``step``, before its backward."""

    def after_step(self, step: int, rank: int) -> None:
        """``step`` is done on this rank (reported, not yet saved)."""

    def save_options(self, step: int) -> dict[str, Any]:
        """Extra keyword arguments of ``save_checkpoint`` for the save of ``step``."""


class NoFaults:
    """The hooks of a run without faults: they change nothing."""

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_step(self, step: int, rank: int) -> None:
        return None

    def save_options(self, step: int) -> dict[str, Any]:
        return {}


NO_FAULTS = NoFaults()


@dataclass(frozen=True)
class Faults:
    """The armed faults, behind the loop's hook points (``Hooks``)."""

    faults: tuple[Fault, ...]

    def _due(self, kind: str, step: int, rank: int) -> bool:
        return any(f.kind == kind and f.hits(step, rank) for f in self.faults)

    def nan_loss(self, step: int) -> bool:
        return self._due("nan", step, 0)

    def crash_during_save(self, step: int) -> bool:
        return self._due("crash_save", step, 0)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``nan@STEP``: the loss times NaN, so its gradients are NaN too."""
        return loss * float("nan") if self.nan_loss(step) else loss

    def save_options(self, step: int) -> dict[str, Any]:
        """``crash_save@STEP``: the save exits once its shards are written."""
        return {"crash_after_shards": self.crash_during_save(step)}

    def after_step(self, step: int, rank: int) -> None:
        """Kill, stop or fail this process, where a fault says so."""
        for kind, sent in _SIGNALS.items():
            if self._due(kind, step, rank):
                # to this thread, not the process: a process-directed SIGSTOP may be taken by
                # another thread while this one runs on into the next collective before it stops
                signal.raise_signal(sent)
        if self._due("raise", step, rank):
            raise InjectedFault(f"fault injection: rank {rank} fails after step {step} ({VARIABLE})")


def parse(value: str) -> Faults:
    faults = []
    for entry in value.replace(" ", "").split(","):
        match = _ENTRY.match(entry)
        if match is None or (match["kind"] in _PER_RANK) != (match["rank"] is not None):
            raise ConfigError(VARIABLE, value, f"unset it, or give {FORMAT}",
                              reason=f"cannot read {entry!r}")
        faults.append(Fault(match["kind"], int(match["step"]), match["rank"]))
    return Faults(tuple(faults))


def arm() -> Faults | None:
    """The faults this process was started with, or ``None`` (unset, or a restarted attempt)."""
    value = os.environ.get(VARIABLE)
    if not value:
        return None
    faults = parse(value)  # checked on every attempt, so a bad value never waits for a restart
    return None if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" else faults


def hooks() -> Faults | NoFaults:
    """The loop's hook points for this process: the armed faults, or ``NO_FAULTS``."""
    armed = arm()
    return NO_FAULTS if armed is None else armed
