"""The rank pool: ranks started once serve call after call, each call in a fresh process
group and fresh process state; a failure or a hang fails that call alone and retires the
ranks, so the next call runs on new ones."""

import os
import time

import pytest
import torch
from test_core_harness import _rank_1_dies

from fsdp_turbo.core.testing import RankFailure, run_distributed, run_reference
from fsdp_turbo.core.testing.pool import RankPool, active_pool, pooled_ranks

pytestmark = pytest.mark.multirank


def _pid_and_sum():
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return os.getpid(), float(value)


def _dirty_the_process():
    """Change what a new process would not have, and report what this call started with."""
    from fsdp_turbo.core import logging as turbo_logging
    from fsdp_turbo.core.logging import get_logger, warn_once

    seen = {"env": os.environ.get("POOL_TEST_LEFTOVER"), "draw": float(torch.rand(())),
            "dtype": str(torch.get_default_dtype()), "warned": "pool test warning" in turbo_logging._seen}
    os.environ["POOL_TEST_LEFTOVER"] = "1"
    torch.set_default_dtype(torch.float64)
    warn_once(get_logger(__name__), "pool test warning")
    return seen


def _fresh_draw():
    return float(torch.rand(()))


def _fail_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise KeyError("boom")
    dist.barrier()  # the healthy ranks wait for a peer that never comes
    return "unreachable"


def _hang_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    return dist.get_rank()


def _raise_everywhere():
    raise ValueError("same on every rank")


@pytest.fixture
def pool():
    pool = RankPool(2)
    yield pool
    pool.close()


def test_the_same_ranks_serve_every_call(pool):
    first = pool.run(_pid_and_sum, timeout=60)
    second = pool.run(_pid_and_sum, timeout=60)
    assert [s for _, s in first] == [1.0, 1.0]
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # no new processes
    assert (pool.starts, pool.calls) == (1, 2)


def test_every_call_starts_from_a_new_process_state(pool):
    fresh = run_reference(_fresh_draw)  # torch's default seed, in a new process
    first, second = pool.run(_dirty_the_process, timeout=60), pool.run(_dirty_the_process, timeout=60)
    for seen in (*first, *second):
        assert seen == {"env": None, "draw": fresh, "dtype": "torch.float32", "warned": False}
    assert pool.starts == 1


def test_a_failing_rank_fails_the_call_and_the_next_call_gets_new_ranks(pool):
    before = [pid for pid, _ in pool.run(_pid_and_sum, timeout=60)]
    with pytest.raises(KeyError, match="boom") as info:
        pool.run(_fail_on_rank, 1, timeout=120)
    assert any("rank 1 of 2" in note for note in info.value.__notes__)
    assert "Traceback" in str(info.value.__cause__)
    after = [pid for pid, _ in pool.run(_pid_and_sum, timeout=60)]
    assert not set(before) & set(after) and pool.starts == 2


def test_a_rank_that_dies_is_reported_and_the_pool_restarts(pool):
    with pytest.raises(RankFailure, match="rank 1 was killed by signal 9 and left no result"):
        pool.run(_rank_1_dies, timeout=120)
    assert [s for _, s in pool.run(_pid_and_sum, timeout=60)] == [1.0, 1.0]
    assert pool.starts == 2


def test_a_hang_is_reported_and_the_pool_restarts(pool):
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 3s"):
        pool.run(_hang_on_rank, 0, timeout=3)
    assert [s for _, s in pool.run(_pid_and_sum, timeout=60)] == [1.0, 1.0]
    assert pool.starts == 2


def test_expected_errors_keep_the_pool(pool):
    errors = pool.run(_raise_everywhere, timeout=60, return_exceptions=True)
    assert [type(e) for e in errors] == [ValueError, ValueError]
    pool.run(_pid_and_sum, timeout=60)
    assert pool.starts == 1


def test_run_distributed_uses_the_open_pool_per_world_size():
    assert active_pool(2) is None  # no pool outside the block
    with pooled_ranks() as pools:
        first = run_distributed(_pid_and_sum, 2, timeout=60)
        again = run_distributed(_pid_and_sum, 2, timeout=60)
        assert run_reference(_fresh_draw) == run_reference(_fresh_draw)
        assert sorted(pools) == [1, 2]
        assert [pid for pid, _ in first] == [pid for pid, _ in again]
    assert active_pool(2) is None
