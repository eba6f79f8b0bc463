"""One rank's error is every rank's error: local work followed by an all-ranks agreement.

A step that can fail on one rank only (a file missing on one node's disk, a rank-0-only
write to a read-only folder, a batch that cannot be read) would leave the other ranks
waiting in their next collective until its timeout. ``every_rank_or_none`` runs such a
step and then agrees on its outcome with one small all-reduce: when any rank failed,
every rank raises before it reaches another collective. The failing rank raises its own
error; the others raise ``PeerFailure`` carrying the first failing rank's message, so
every rank's log says what went wrong and where.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


class PeerFailure(RuntimeError):
    """Another rank failed in a step every rank takes together; this rank stops too."""

    def __init__(self, what: str, rank: int, message: str) -> None:
        self.what, self.rank, self.message = what, rank, message
        super().__init__(f"{what}: rank {rank} failed, so every rank stops. Rank {rank}'s error: {message}")

    def __reduce__(self):
        return (PeerFailure, (self.what, self.rank, self.message))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def agree(what: str, failure: BaseException | None, device: torch.device | str = "cpu",
          group: dist.ProcessGroup | None = None) -> None:
    """Every rank calls this with its own outcome; raises on every rank when any failed
    (the failing rank its own error). Costs one all-reduce of one number; a second
    exchange (of the failing rank's message) only when something failed. ``group``: where to
    agree (the default group; a thread of its own needs a group of its own)."""
    if _distributed():
        # The lowest failing rank wins: 1 + (world - rank), so MAX picks the smallest rank.
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        flag = torch.tensor([0 if failure is None else 1 + world - rank], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            first = world + 1 - int(flag.item())
            messages: list[str | None] = [None] * world
            dist.all_gather_object(messages, None if failure is None else describe(failure), group=group)
            if failure is None:
                raise PeerFailure(what, first, messages[first] or "(no message)")
    if failure is not None:
        raise failure


@contextmanager
def every_rank_or_none(what: str, device: torch.device | str = "cpu",
                       group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run a rank's local part of a step every rank takes; if any rank fails, every rank
    raises (see ``agree``), so no rank walks on into a collective the others never reach."""
    failure: BaseException | None = None
    try:
        yield
    except Exception as error:  # re-raised by ``agree``, after the other ranks have heard of it
        failure = error
    agree(what, failure, device, group)
