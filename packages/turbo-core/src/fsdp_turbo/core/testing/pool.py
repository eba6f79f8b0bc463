"""A pool of N ranks started once, for many distributed tests in turn.

Starting ranks costs more than most tests: a fork, torch's first calls in a new process
(operator and kernel set-up, dynamo's and inductor's imports and compiled kernels), and the
model files a test first touches. A :class:`RankPool` keeps its ranks and sends them one test
function after another; each call still gets its own gloo process group, over a fresh
store, so no collective state crosses from one test to the next.

Isolation, and what a test must not rely on:

* Before each call every rank restores what a new process would have: the environment as
  the pool started it, torch's default RNG seed, the default dtype, grad mode, the thread
  count, and FSDPTurbo's warn-once memory; dynamo's caches and counters and every cache of
  ``torch.distributed`` (DTensor's propagation caches hold meshes) are emptied.
* A call that fails without ``return_exceptions`` (the test fails anyway), a rank that
  dies, and a call past its timeout all retire the pool: its ranks are killed and the next
  call starts new ones, so a broken or hung test never poisons the next. The failure is
  reported as :func:`~fsdp_turbo.core.testing.run_distributed` reports it: the earliest
  failing rank's error with its traceback, or a ``TimeoutError`` naming the ranks.
* A test that changes process-wide state on purpose (registers an op or an expert form
  and leaves it, patches a library) must not use a pool.

Tests reach a pool through :func:`run_distributed`: inside ``with pooled_ranks():`` its
calls run on pool ranks, one pool per world size. Under pytest, the plugin
``fsdp_turbo.core.testing.pytest_plugin`` keeps one set of pools per session (so per xdist
worker) and opens it for the modules marked ``rank_pool``.

torch's ``MultiProcContinuousTest`` is the same idea for ``unittest`` classes, with one
world size per class and no per-call group; these tests are pytest functions that pick
their world size per call and need the rank results back.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from fsdp_turbo.core.testing.ranks import (
    _GRACE_S,
    _died,
    _join_group,
    _mp_context,
    _Outcome,
    _payload,
    _raise_from,
    _rank_environment,
    device_under_test,
)

_active: dict[int, RankPool] | None = None


class RankPool:
    """``world_size`` ranks started once; :meth:`run` sends one function to all of them."""

    def __init__(self, world_size: int, *, backend: str | None = None, num_threads: int = 1) -> None:
        from fsdp_turbo.core.device import backend_for

        self.world_size = world_size
        self.backend = backend or backend_for(device_under_test())
        self.num_threads = num_threads
        self.calls = 0  # calls served by the current ranks
        self.starts = 0  # how many times ranks were started (1 + retirements)
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []

    # -- lifecycle ---------------------------------------------------------------------
    def _start(self) -> None:
        ctx = _mp_context()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.world_size, self.num_threads, child),
                               name=f"fsdp-turbo-pool-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.starts += 1
        self.calls = 0

    def close(self) -> None:
        """Stop the ranks (a polite stop, then a kill)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    # -- one call ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, init_process_group: bool = True,
            return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results by rank, as :func:`run_distributed`."""
        import torch.distributed as dist

        if not self._procs:
            self._start()
        store = None
        port = None
        if init_process_group:
            store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
            port = store.port
        task = pickle.dumps((port, self.backend, list(sys.path), pickle.dumps((fn, args, kwargs))))
        retire = True
        try:
            for conn in self._conns:
                conn.send_bytes(task)
            outcomes, complete = _collect(self._conns, self._procs, timeout, return_exceptions)
            failed = [rank for rank, outcome in outcomes.items() if not outcome.ok]
            retire = not complete or (bool(failed) and not return_exceptions)
            if failed and not return_exceptions:
                root = min(failed, key=lambda r: outcomes[r].when)
                _raise_from(root, self.world_size, outcomes[root])
            self.calls += 1
            return [outcomes[rank].value for rank in range(self.world_size)]
        finally:
            if retire:
                self.close()
            del store


def _collect(conns: list[Connection], procs: list, timeout: float,
             return_exceptions: bool) -> tuple[dict[int, _Outcome], bool]:
    """Each rank's outcome; ``complete`` is False when some rank gave none (it died, hung,
    or was still running when the earliest failure's grace ran out)."""
    world_size = len(conns)
    outcomes: dict[int, _Outcome] = {}
    deadline = time.monotonic() + timeout
    failure_seen = False
    while len(outcomes) < world_size:
        waiting = [rank for rank in range(world_size) if rank not in outcomes]
        ready = wait([conns[r] for r in waiting] + [procs[r].sentinel for r in waiting],
                     timeout=max(0.0, deadline - time.monotonic()))
        for rank in waiting:
            if conns[rank] in ready:
                try:
                    outcomes[rank] = pickle.loads(conns[rank].recv_bytes())
                except (EOFError, OSError):  # the pipe closes as a rank dies: say how it died
                    procs[rank].join(timeout=5)
                    outcomes[rank] = _died(rank, procs[rank].exitcode)
            elif procs[rank].sentinel in ready:
                outcomes[rank] = _died(rank, procs[rank].exitcode)
            if rank in outcomes and not outcomes[rank].ok and not failure_seen and not return_exceptions:
                failure_seen = True
                # the peers of a failed rank usually fail soon after (closed connections)
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if len(outcomes) < world_size and time.monotonic() >= deadline:
            if failure_seen:
                return outcomes, False
            missing = [r for r in range(world_size) if r not in outcomes]
            raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
    return outcomes, True


# -- the rank side -----------------------------------------------------------------------
def _serve(rank: int, world_size: int, num_threads: int, conn: Connection) -> None:
    """A pool rank: run each task it is sent, in a fresh process group, until told to stop."""
    faulthandler.enable()  # a crash in native code leaves no result: its stack on stderr says where
    os.environ.update(_rank_environment(rank, world_size))
    fresh = _FreshState.capture(num_threads)
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message is None:
            return
        port, backend, path, call = message
        fresh.restore()
        sys.path[:] = path  # before unpickling the function: its module may live on the test's path
        outcome = _run_task(rank, world_size, port, backend, call)
        conn.send_bytes(_payload(outcome))


def _run_task(rank: int, world_size: int, port: int | None, backend: str, call: bytes) -> _Outcome:
    import torch.distributed as dist

    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    try:
        fn, args, kwargs = pickle.loads(call)
        if port is not None:
            _join_group(rank, world_size, port, backend)
        return _Outcome(True, fn(*args, **kwargs))
    except BaseException as error:
        return _Outcome(False, error, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _FreshState:
    """What a new rank process starts with, restored before every task."""

    def __init__(self, environ: dict[str, str], seed: int, dtype: Any, num_threads: int) -> None:
        self.environ, self.seed, self.dtype, self.num_threads = environ, seed, dtype, num_threads

    @classmethod
    def capture(cls, num_threads: int) -> _FreshState:
        import torch

        return cls(dict(os.environ), torch.initial_seed(), torch.get_default_dtype(), num_threads)

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        torch.manual_seed(self.seed)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(self.num_threads)
        from fsdp_turbo.core import logging as turbo_logging

        turbo_logging.forget_warnings()
        if "torch._dynamo" in sys.modules:
            import torch._dynamo

            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        _clear_distributed_caches()


def _clear_distributed_caches() -> None:
    """Empty every ``functools`` cache of ``torch.distributed``.

    A ``DeviceMesh`` compares equal to another of the same ranks and names whatever its
    process groups, so DTensor's sharding-propagation and redistribution caches would hand
    the next test's ops the previous test's mesh, whose groups are destroyed (seen as
    "Could not resolve the process group" and failed unpadding checks). Some of these
    caches are built inside functions, out of reach by name, so they are found by type;
    DTensor's C++ dispatch keeps one more (torch 2.10 and later).
    """
    import torch

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    for cached in gc.get_objects():
        # type(), not isinstance(): the heap holds weak proxies, and a dead one raises on isinstance
        if type(cached) is functools._lru_cache_wrapper:
            module = getattr(getattr(cached, "__wrapped__", None), "__module__", None) or ""
            if module.startswith("torch.distributed"):
                cached.cache_clear()


@contextlib.contextmanager
def pooled_ranks(pools: dict[int, RankPool] | None = None) -> Iterator[dict[int, RankPool]]:
    """Inside this block :func:`run_distributed` runs on pool ranks, one pool per world size.

    ``pools`` lets several blocks share ranks (the pytest plugin keeps one set per test
    session, that is per xdist worker); pools this block creates are closed when it ends.
    """
    global _active
    if _active is not None:  # nested: the outer pools serve
        yield _active
        return
    owned = pools is None
    _active = {} if pools is None else pools
    try:
        yield _active
    finally:
        active, _active = _active, None
        if owned:
            for pool in active.values():
                pool.close()


def active_pool(world_size: int) -> RankPool | None:
    """The pool serving ``world_size`` ranks inside :func:`pooled_ranks`, started on first use."""
    if _active is None:
        return None
    if world_size not in _active:
        _active[world_size] = RankPool(world_size)
    return _active[world_size]
