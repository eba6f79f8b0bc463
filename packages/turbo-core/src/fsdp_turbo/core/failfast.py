"""A rank's uncaught error ends every rank of the job at once, wherever the others are.

The agreements (``core.agreement``) cover the steps a rank can fail at alone. Anything
else (one rank out of memory in its forward, a bug on one rank) leaves the others waiting
in their next collective. gloo notices when the failed process exits and closes its
connections; NCCL and HCCL wait for the collective timeout (minutes). So a worker posts
its error to the job's rendezvous store (the TCPStore torchrun's ``MASTER_ADDR`` and
``MASTER_PORT`` name) before it exits, and a watcher thread in every worker waits on that
key: the first error posted ends every worker within about a second, each logging the
failing rank's message. The store is rank 0's: when it is gone, rank 0 is gone, and the
watcher ends this worker too. ``close`` (with a barrier after it) ends the watch before
a clean exit, so one rank's normal end is never taken for a failure.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch.distributed as dist

from fsdp_turbo.core.agreement import describe
from fsdp_turbo.core.logging import get_logger

_log = get_logger(__name__)
EXIT_CODE = 70  # what a worker ended by a peer's error exits with (EX_SOFTWARE)
_POLL_S = 1.0


def _key() -> str:
    # One key per attempt: a store shared between torchrun restarts must not end the next one.
    return (f"fsdp_turbo/failed/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


class FailFast:
    """Watch the job's store for a peer's posted error; post this rank's own."""

    def __init__(self, rank: int, host: str, port: int) -> None:
        self.rank, self.key = rank, _key()
        timeout = datetime.timedelta(seconds=60)
        # Two clients: the watcher blocks in ``wait`` on its own connection.
        self._poster = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._watched = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fsdp-turbo-failfast", daemon=True)
        self._thread.start()

    @classmethod
    def from_environment(cls) -> FailFast:
        """For a worker torchrun started (it sets ``MASTER_ADDR``/``MASTER_PORT`` and ``RANK``)."""
        return cls(int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def _watch(self) -> None:
        # ``check`` answers at once; a blocking ``wait`` with a timeout would log a C++
        # warning at every timeout, and could not be ended by ``close``.
        while not self._closed.wait(_POLL_S):
            try:
                posted = self._watched.check([self.key])
            except (dist.DistNetworkError, RuntimeError) as error:
                self._end(f"the job's store (hosted by rank 0) is gone, so rank 0 is: {error}")
                return
            if posted:
                self._end(self._watched.get(self.key).decode(errors="replace"))
                return

    def _end(self, message: str) -> None:
        if self._closed.is_set():
            return  # a clean exit is under way
        _log.error(f"rank {self.rank} stops: {message}", all_ranks=True)
        os._exit(EXIT_CODE)  # this rank may sit in a collective no error will ever end

    def post(self, error: BaseException) -> None:
        """Tell every rank this one failed (the first error posted is the one they log)."""
        self._closed.set()  # this rank exits through its own error, not through the watcher
        try:
            self._poster.compare_set(self.key, "", f"rank {self.rank} failed: {describe(error)}")
        except (dist.DistError, RuntimeError) as lost:  # the store is gone: the others learn of it that way
            _log.warning(f"could not post this rank's error to the job's store ({lost})", all_ranks=True)

    def close(self) -> None:
        """End the watch; every rank calls this, then a barrier, before a clean exit (so no
        rank's store connection is in use when rank 0 exits and takes the store with it)."""
        self._closed.set()
        self._thread.join()
