"""One multi-rank launch at a time across the test processes of a session.

Why: pytest-xdist runs two test processes on CI's two cores, and two launches side by side
put four or more ranks on them. A rank then waits in every collective for a peer the
scheduler has put aside, so two launches together take longer than one after the other (the
new-families file: 133 s side by side, 109 s in turn). Under the lock a launch runs on
cores of its own while the other test process does single-process work: building models,
references, assertions.

The lock is opt-in: ``$FSDP_TURBO_LAUNCH_LOCK`` names a lock file shared by the session's
processes (the noxfile sets it). Without it every call runs at once, as before. Where
``fcntl`` is missing (Windows) there is no lock either.

The lock is held per process and re-entered freely, so a helper that launches inside
another launch's hold never waits for itself. The time a test waits for the lock is not
part of a launch's own timeout (which starts when the lock is held).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

LAUNCH_LOCK_ENV = "FSDP_TURBO_LAUNCH_LOCK"

_held = threading.local()


@contextlib.contextmanager
def one_launch_at_a_time() -> Iterator[None]:
    """Hold the session's launch lock (``$FSDP_TURBO_LAUNCH_LOCK``) for the block, if one is set."""
    path = os.environ.get(LAUNCH_LOCK_ENV, "")
    depth = getattr(_held, "depth", 0)
    try:
        import fcntl
    except ImportError:  # no flock here: launches run side by side
        fcntl = None
    if not path or depth or fcntl is None:
        _held.depth = depth + 1
        try:
            yield
        finally:
            _held.depth = depth
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0
            fcntl.flock(handle, fcntl.LOCK_UN)
