"""The bad-input suite's one-rank cases (``one_rank_failures.py``): a fault only some ranks
meet ends every rank within 60 s, each with the failing rank's message. The process group's
timeout is gloo's default (30 minutes), so a rank left waiting in a collective would show."""

import pytest
from one_rank_failures import CASES, WORLD, prepare_data, run_cases

from fsdp_turbo.core.testing import run_distributed

pytest.importorskip("transformers")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_one_rank")]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    inputs = prepare_data(tmp_path_factory.mktemp("one_rank"))
    return run_distributed(run_cases, WORLD, list(CASES), inputs, timeout=600)


@pytest.mark.bad_input_one_rank
@pytest.mark.parametrize("name", list(CASES))
def test_a_fault_one_rank_meets_ends_every_rank_with_its_message(name, outcomes):
    case = CASES[name]
    raised = [per_rank[name] for per_rank in outcomes]
    first = min(case.failing)
    for rank, (kind, message, _) in enumerate(raised):
        if rank in case.failing:
            assert kind == case.error, (rank, kind, message)
        else:  # a peer: stopped by the agreement, naming the failing rank and repeating its error
            assert kind == "PeerFailure", (rank, kind, message)
            assert f"rank {first} failed" in message and case.error in message, message
        assert case.says in message, (rank, message)
    failed_at = min(ended for rank, (_, _, ended) in enumerate(raised) if rank in case.failing)
    assert max(ended for _, _, ended in raised) - failed_at < 60  # not the collective timeout
