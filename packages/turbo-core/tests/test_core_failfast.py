"""``FailFast``: a rank's posted error ends every rank at once, even ranks sitting in a
collective the failed rank never joins, while its process lives on (as an NCCL rank's
would: NCCL notices nothing until the collective timeout; gloo's 30-minute default here)."""

import os
import time
from pathlib import Path

import pytest

from fsdp_turbo.core.failfast import EXIT_CODE, FailFast
from fsdp_turbo.core.testing import RankFailure, run_distributed

pytestmark = pytest.mark.multirank
WORLD = 3


def _ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited (a zombie until the harness reaps it)


def _rank_1_fails_and_lingers():
    import torch.distributed as dist

    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    watch = FailFast.from_environment()
    if dist.get_rank() == 1:
        watch.post(MemoryError("out of memory in the forward of rank 1"))
        # Alive, its connections open, so the peers' barrier cannot fail by itself: only
        # their watchers can end them. Linger until they have (at most a minute).
        deadline = time.monotonic() + 60
        while not all(_ended(pid) for rank, pid in enumerate(pids) if rank != 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        return "rank 1 lingered"
    dist.barrier()  # never completes: rank 1 does not come
    return "unreachable"


def _clean_run():
    import torch.distributed as dist

    watch = FailFast.from_environment()
    dist.barrier()
    watch.close()
    dist.barrier()
    return dist.get_rank()


def test_a_posted_error_ends_the_ranks_waiting_in_a_collective():
    outcomes = run_distributed(_rank_1_fails_and_lingers, WORLD, timeout=120, return_exceptions=True)
    assert outcomes[1] == "rank 1 lingered"
    for rank in (0, 2):  # ended by their watcher (its exit code), not by an error of their own
        assert isinstance(outcomes[rank], RankFailure), outcomes[rank]
        assert f"exited with code {EXIT_CODE}" in str(outcomes[rank])


def test_a_clean_run_is_not_ended():
    assert run_distributed(_clean_run, WORLD, timeout=120) == [0, 1, 2]
