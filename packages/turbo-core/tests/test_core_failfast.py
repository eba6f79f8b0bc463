"""``FailFast``: a rank's posted error ends every rank at once, even ranks sitting in a
collective the failed rank never joins, while its process lives on (as an NCCL rank's
would: NCCL notices nothing until the collective timeout; gloo's 30-minute default here)."""

import time

import pytest

from fsdp_turbo.core.failfast import EXIT_CODE, FailFast
from fsdp_turbo.core.testing import RankFailure, run_distributed

pytestmark = pytest.mark.multirank
WORLD = 3


def _rank_1_fails_and_lingers():
    import torch.distributed as dist

    watch = FailFast.from_environment()
    if dist.get_rank() == 1:
        watch.post(MemoryError("out of memory in the forward of rank 1"))
        time.sleep(8)  # alive, its connections open: the peers' barrier does not fail by itself
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
