"""Packing is exact: a packed batch trains (the losses of 3 steps, the first step's
gradients) and evaluates (after those steps) as its documents would, each run alone,
at FSDP2 x TP2 with sequence parallel and a loss-parallel head, at CP2 x FSDP2, and at
HSDP 2x2 with the chunked loss (4 gloo ranks, float32)."""

import pytest
from data_jobs import DP, packed_run, reference

from fsdp_turbo.core.testing import assert_parity, run_distributed

pytest.importorskip("datasets")
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_data_parity")]  # module fixtures built once


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def expected(cache):
    return {dp: reference(cache, dp) for dp in sorted(set(DP.values()))}


@pytest.mark.parametrize("layout", list(DP))
def test_a_packed_batch_trains_and_evaluates_as_each_document_alone(layout, cache, expected):
    record, eval_loss = expected[DP[layout]]
    for got_record, got_eval in run_distributed(packed_run, 4, cache, layout, timeout=600):
        assert_parity(record, got_record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
        assert abs(got_eval - eval_loss) < 1e-5 * abs(eval_loss), (got_eval, eval_loss)
