"""Spawn N ranks on gloo, gather their results, and never hang.

Why not ``torch.multiprocessing.spawn`` or torch's ``MultiProcessTestCase``: the first
returns nothing and waits forever on a rank stuck in a collective, the second is a private
test API tied to unittest. Tests here need each rank's return value, the earliest failing
rank's own traceback, and one deadline that kills every rank.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from fsdp_turbo.core.testing.pool import active_pool
from fsdp_turbo.core.testing.ranks import (
    _GRACE_S,
    _POLL_S,
    TEST_DEVICE_ENV,
    RankFailure,
    _died,
    _join_group,
    _mp_context,
    _Outcome,
    _payload,
    _raise_from,
    _rank_environment,
    device_under_test,
)

__all__ = ["TEST_DEVICE_ENV", "RankFailure", "device_under_test", "run_distributed", "run_reference"]


def _worker(rank: int, world_size: int, port: int | None, backend: str, num_threads: int,
            fn: Callable[..., Any], args: tuple, kwargs: dict, out_dir: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that dies in native code (a segfault, an abort) leaves no result; its stack on
    # stderr is then the only trace of where it died.
    faulthandler.enable()
    os.environ.update(_rank_environment(rank, world_size))
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(num_threads)
    try:
        if port is not None:
            _join_group(rank, world_size, port, backend)
        outcome = _Outcome(True, fn(*args, **kwargs))
    except BaseException as error:
        outcome = _Outcome(False, error, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    payload = _payload(outcome)
    tmp = os.path.join(out_dir, f"{rank}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(payload)
    os.replace(tmp, os.path.join(out_dir, f"{rank}.pkl"))


def _read(out_dir: str, rank: int) -> _Outcome | None:
    path = os.path.join(out_dir, f"{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as handle:
        return pickle.load(handle)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str | None = None,
    init_process_group: bool = True,
    num_threads: int = 1,
    return_exceptions: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return their results by rank.

    ``fn`` must be importable by name (a module-level function). A rank's error is
    re-raised here with its remote traceback; the others are then stopped. With
    ``return_exceptions=True`` the per-rank exceptions are returned instead, so a
    test can check that every rank raised the same error. Exceeding ``timeout``
    kills every rank and raises ``TimeoutError``. The backend follows
    ``$FSDP_TURBO_TEST_DEVICE`` (gloo on cpu, the default).

    Inside :func:`~fsdp_turbo.core.testing.pool.pooled_ranks` the call runs on the pool's
    ranks for ``world_size`` (started once, each call in a fresh process group); otherwise
    on ranks forked for this call alone.
    """
    import torch.distributed as dist

    pool = active_pool(world_size) if backend is None and num_threads == 1 else None
    if pool is not None:
        return pool.run(fn, *args, timeout=timeout, init_process_group=init_process_group,
                        return_exceptions=return_exceptions, **kwargs)

    from fsdp_turbo.core.device import backend_for

    backend = backend or backend_for(device_under_test())
    store = None
    port = None
    if init_process_group:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        port = store.port
    out_dir = tempfile.mkdtemp(prefix="fsdp_turbo_ranks_")
    ctx = _mp_context()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, backend, num_threads, fn, args, kwargs, out_dir),
                    name=f"fsdp-turbo-rank{rank}")
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        outcomes = _collect(procs, out_dir, timeout, return_exceptions)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        shutil.rmtree(out_dir, ignore_errors=True)
        del store
    return [o.value for o in outcomes]


def _collect(procs: list, out_dir: str, timeout: float, return_exceptions: bool) -> list[_Outcome]:
    world_size = len(procs)
    outcomes: dict[int, _Outcome] = {}
    first_failure: int | None = None
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        for rank, proc in enumerate(procs):
            if rank in outcomes:
                continue
            outcome = _read(out_dir, rank)
            if outcome is None and not proc.is_alive():
                outcome = _read(out_dir, rank) or _died(rank, proc.exitcode)
            if outcome is not None:
                outcomes[rank] = outcome
                if not outcome.ok and first_failure is None:
                    first_failure = rank
                    if not return_exceptions:
                        deadline = min(deadline, time.monotonic() + _GRACE_S)
        if len(outcomes) == world_size:
            break
        if time.monotonic() > deadline:
            if first_failure is not None:
                break
            missing = [r for r in range(world_size) if r not in outcomes]
            raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
        time.sleep(_POLL_S)
    if first_failure is not None and not return_exceptions:
        # The root cause is the earliest error; peers usually fail after it (closed connections).
        failed = [r for r, o in outcomes.items() if not o.ok]
        root = min(failed, key=lambda r: outcomes[r].when)
        _raise_from(root, world_size, outcomes[root])
    return [outcomes[rank] for rank in range(world_size)]


def run_reference(fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
    """Run ``fn`` in one fresh process with no process group: the parity reference."""
    return run_distributed(fn, 1, *args, timeout=timeout, init_process_group=False, **kwargs)[0]
