"""The bad-input suite: configs, job files, data, checkpoints and runtime misuse, each on
4 gloo ranks. Every rank must raise the same clear error (its class and message), and
none may hang: all cases run in one set of ranks under one timeout. The session prints
how many distinct cases there are (integration_tests/conftest.py)."""

import pytest
from bad_inputs import CASES, prepare_checkpoints, run_cases

from fsdp_turbo.core.testing import run_distributed

pytest.importorskip("transformers")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_bad_inputs")]
WORLD = 4


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    inputs = prepare_checkpoints(tmp_path_factory.mktemp("bad_inputs"))
    return run_distributed(run_cases, WORLD, list(CASES), inputs, timeout=600)


def test_the_suite_covers_every_kind_of_input():
    kinds = {case.category for case in CASES.values()}
    assert kinds == {"config", "job file", "data", "checkpoint", "runtime"}
    assert len(CASES) >= 40


@pytest.mark.bad_input
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_clear_error(name, outcomes):
    case = CASES[name]
    raised = [per_rank[name] for per_rank in outcomes]
    assert {kind for kind, _ in raised} == {case.error}, raised
    assert len({message for _, message in raised}) == 1, raised  # the same words on every rank
    message = raised[0][1]
    assert case.says in message, message
    if case.error in ("ConfigError", "CheckpointError"):
        assert "Fix:" in message  # it names the fix
