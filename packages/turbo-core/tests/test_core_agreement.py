"""One rank's error is every rank's error: ``every_rank_or_none`` on real gloo ranks."""

import time

import pytest
import torch

from fsdp_turbo.core.agreement import PeerFailure, every_rank_or_none
from fsdp_turbo.core.testing import run_distributed

pytestmark = pytest.mark.multirank
WORLD = 3


def _fail_on(failing: list[int]):
    import torch.distributed as dist

    rank = dist.get_rank()
    with every_rank_or_none("read the batch"):
        if rank in failing:
            raise FileNotFoundError(f"/data/node{rank}/part-0.jsonl")
    dist.barrier()  # reached only when no rank failed
    return "went on"


def _timed_failure():
    """Rank 2 fails after a second of work; every rank reports how long it took to stop."""
    import torch.distributed as dist

    began = time.monotonic()
    try:
        with every_rank_or_none("write the metrics"):
            if dist.get_rank() == 2:
                time.sleep(1.0)
                raise OSError("read-only file system")
    except Exception as error:  # the outcome is the test's data
        return type(error).__name__, str(error), time.monotonic() - began
    return None


def test_no_failure_walks_on():
    assert run_distributed(_fail_on, WORLD, [], timeout=120) == ["went on"] * WORLD


def test_one_rank_failure_stops_every_rank_with_its_message():
    errors = run_distributed(_fail_on, WORLD, [1], timeout=120, return_exceptions=True)
    assert isinstance(errors[1], FileNotFoundError)  # the failing rank: its own error
    for rank in (0, 2):
        assert isinstance(errors[rank], PeerFailure), errors[rank]
        assert errors[rank].rank == 1
        assert "read the batch: rank 1 failed" in str(errors[rank])
        assert "FileNotFoundError: /data/node1/part-0.jsonl" in str(errors[rank])


def test_the_lowest_failing_rank_is_named():
    errors = run_distributed(_fail_on, WORLD, [2, 1], timeout=120, return_exceptions=True)
    assert isinstance(errors[0], PeerFailure) and errors[0].rank == 1
    assert [type(e) for e in errors[1:]] == [FileNotFoundError, FileNotFoundError]


def test_peers_stop_when_the_failing_rank_does_not_at_a_timeout():
    """The process group's timeout is the harness's (minutes): peers that waited for it
    would take that long. They stop as soon as rank 2 has failed."""
    outcomes = run_distributed(_timed_failure, WORLD, timeout=120)
    assert [kind for kind, _, _ in outcomes] == ["PeerFailure", "PeerFailure", "OSError"]
    assert all("rank 2 failed" in message for _, message, _ in outcomes[:2])
    print("seconds to stop, by rank:", [round(seconds, 2) for _, _, seconds in outcomes])
    assert max(seconds for _, _, seconds in outcomes) < 60


def test_without_a_process_group_the_error_is_raised_as_it_is():
    with pytest.raises(KeyError), every_rank_or_none("anything"):
        raise KeyError("x")
    with every_rank_or_none("anything", torch.device("cpu")):
        pass
