"""The multi-rank harness: results by rank, error re-raise, timeouts, reference runner."""

import os
import time

import pytest
import torch

from fsdp_turbo.core.testing import RankFailure, run_distributed, run_reference

pytestmark = pytest.mark.multirank


def _all_reduce_rank():
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), float(value)


def _fail_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise KeyError("boom")
    dist.barrier()  # the healthy ranks wait for a peer that never comes
    return "unreachable"


def _rank_1_dies():
    import signal

    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)  # its peer is waiting in the next barrier: it fails on the reset connection
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {"float32": base, "view": base[1:, ::2], "bfloat16": base.bfloat16(), "bool": base > 3,
            "int64": torch.arange(5), "needs_grad": torch.ones(2, requires_grad=True), "scalar": torch.tensor(2.5)}


def _sleep_forever():
    time.sleep(3600)


def _raise_everywhere():
    raise ValueError(f"same on every rank ({os.environ['WORLD_SIZE']})")


def _no_process_group():
    import torch.distributed as dist

    return dist.is_initialized(), os.environ["WORLD_SIZE"]


def test_results_come_back_by_rank():
    assert run_distributed(_all_reduce_rank, 4, timeout=60) == [(r, 4, 6.0) for r in range(4)]


def test_failing_rank_error_is_reraised_and_peers_are_stopped():
    started = time.monotonic()
    with pytest.raises(KeyError, match="boom") as info:
        run_distributed(_fail_on_rank, 3, 2, timeout=120)
    assert any("rank 2 of 3" in note for note in info.value.__notes__)
    assert "Traceback" in str(info.value.__cause__)
    assert time.monotonic() - started < 60


def test_a_rank_that_dies_is_the_root_cause_not_its_peers_reset_connection():
    with pytest.raises(RankFailure, match="rank 1 was killed by signal 9 and left no result") as info:
        run_distributed(_rank_1_dies, 2, timeout=120)
    assert any("rank 1 of 2" in note for note in info.value.__notes__)


def test_tensors_come_back_as_they_were():
    """Plain CPU tensors travel as numpy arrays (fast); the rest through torch's own pickling."""
    expected = _tensors()
    for got in run_distributed(_tensors, 2, timeout=60):
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and got[name].requires_grad == tensor.requires_grad, name
            assert torch.equal(got[name].detach(), tensor.detach()), name


def test_timeout_kills_a_hang():
    with pytest.raises(TimeoutError, match="did not finish within 3s"):
        run_distributed(_sleep_forever, 2, timeout=3)


def test_return_exceptions_gives_every_rank():
    errors = run_distributed(_raise_everywhere, 2, timeout=60, return_exceptions=True)
    assert [type(e) for e in errors] == [ValueError, ValueError]
    assert len({str(e) for e in errors}) == 1


def test_reference_runner_has_no_process_group():
    assert run_reference(_no_process_group) == (False, "1")
