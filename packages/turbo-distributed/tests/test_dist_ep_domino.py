"""The ``domino`` dispatcher on gloo ranks, float32, in two launches (one of 4 ranks, one of 2),
each checking several things:

- training parity through the facade, 4 AdamW steps: domino against the single-process
  reference (each step's loss rtol 1e-5; first-step gradients rtol 1e-4 / atol 1e-6, as the
  other dispatchers) and against ``fused`` (float32 rounding only: loss rtol 1e-6, gradients
  rtol 1e-5 / atol 1e-7): EP=4, EP=2 x expert FSDP 2, EP=2 with 3
  slices, a ModuleList of experts;
- hand-made uneven routing (idle experts, a dropped slot, one rank sending nothing to the
  other) and slices with no token at all, against the unsharded experts (rtol 1e-5 / atol 1e-6);
- the schedule by its events: every all-to-all but the first and the last of each pass is
  issued before another slice's expert GEMMs (forward) or expert backward and waited after
  them, in the backward as in the forward.

The README form and torchtitan's form run under every dispatcher in ``test_dist_ep_forms``.
"""

import pytest
import torch
from distributed_jobs import BATCHES
from ep_jobs import dispatcher_records_run, domino_two_rank_run, merge_rank_grads, reference_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("dist_ep_domino")]

TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}
ROUNDING = {"loss_rtol": 1e-6, "grad_rtol": 1e-5, "grad_atol": 1e-7}
CLOSE = {"rtol": 1e-5, "atol": 1e-6}
# Fewer tokens than the 4 slices on both ranks (rank 1 also drops a slot): empty slices.
TINY_ROUTES = {0: [[1, 6]], 1: [[5, 2], [0, 8]]}


def _config(ep: int, dispatcher: str) -> dict:
    return {"expert_parallel_size": ep, "ep_plan": {"dispatcher": dispatcher}}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(domino_two_rank_run, 2, BATCHES, TINY_ROUTES, timeout=300)


def test_domino_trains_as_fused_and_the_reference_on_4_ranks():
    """EP=4; EP=2 x expert FSDP 2. (With recompute, which lives in turbo-memory: the
    integration matrix's "ep2 x efsdp2 domino + recompute" row.)"""
    configs = [_config(4, "domino"), _config(4, "fused"), _config(2, "domino"), _config(2, "fused")]
    results = run_distributed(dispatcher_records_run, 4, "qwen3_moe", BATCHES, configs, timeout=300)
    expected = run_reference(reference_run, "qwen3_moe", BATCHES, timeout=300)
    for domino4, fused4, domino2, fused2 in results:
        for (domino, _, experts_class), (fused, _, _) in ((domino4, fused4), (domino2, fused2)):
            assert experts_class.startswith("FSDPEP")
            assert_parity(expected, domino, **TOL)
            assert_parity(fused, domino, **ROUNDING)
        # EP=4 keeps 2 of 8 experts per rank; EP=2 x efsdp 2 keeps 4 per EP rank, 2 per rank.
        assert domino4[1]["model.layers.0.mlp.experts.gate_up_proj"][0] == (2, 64, 64)
        assert domino2[1]["model.layers.0.mlp.experts.gate_up_proj"][0] == (2, 64, 64)


def test_domino_trains_as_fused_and_the_reference_on_2_ranks(two_ranks):
    expected = run_reference(reference_run, "mixtral", BATCHES, timeout=300)
    for result in two_ranks:
        (domino, _, _), (fused, _, _) = result["mixtral"]
        assert_parity(expected, domino, **TOL)
        assert_parity(fused, domino, **ROUNDING)


def test_domino_on_a_module_list_of_experts(two_ranks):
    """Each rank holds its own experts: gradients compared after merging every rank's."""
    expected = run_reference(reference_run, "qwen3_moe", BATCHES, None, True, timeout=300)
    domino = merge_rank_grads([result["expert_lists"][0][0] for result in two_ranks])
    fused = merge_rank_grads([result["expert_lists"][1][0] for result in two_ranks])
    assert set(domino) == set(expected.grads) == set(fused)
    for name, grad in expected.grads.items():
        torch.testing.assert_close(domino[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(domino[name], fused[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    for result in two_ranks:
        (domino_record, _, _), (fused_record, _, _) = result["expert_lists"]
        torch.testing.assert_close(torch.tensor(domino_record.losses), torch.tensor(expected.losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(domino_record.losses), torch.tensor(fused_record.losses), rtol=1e-6,
                                   atol=0)


def _assert_matches_whole(result: dict) -> None:
    for got, expected in zip(result["got"], result["expected"], strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)
    assert result["local_grads"]
    for name, grad in result["local_grads"].items():
        torch.testing.assert_close(grad, result["reference_grads"][name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("form", ["fused", "list"])
def test_uneven_routing_with_idle_experts(two_ranks, form):
    """ep_jobs.ROUTES in 3 slices: output, input and routing-weight gradients, expert gradients."""
    for result in two_ranks:
        _assert_matches_whole(result["uneven"][form])


def test_slices_without_tokens(two_ranks):
    """1 and 2 tokens in 4 slices: most slices are empty on both ranks, and still pair up."""
    for rank, result in enumerate(two_ranks):
        tiny = result["tiny"]
        assert tiny["got"][0].shape[0] == len(TINY_ROUTES[rank])
        _assert_matches_whole(tiny)
    # The tokens did reach the experts: some expert weight has a gradient.
    assert any(grad.abs().sum() > 0 for grad in two_ranks[0]["tiny"]["local_grads"].values())


# The schedule for two slices, on every rank. In the backward, slice i's expert backward
# runs from ("combine_grad_wait", i) to ("dispatch_grad_issue", i).
FORWARD_2 = [("dispatch_issue", 0), ("dispatch_issue", 1),
             ("dispatch_wait", 0), ("experts", 0), ("combine_issue", 0),
             ("dispatch_wait", 1), ("experts", 1), ("combine_issue", 1),
             ("combine_wait", 0), ("combine_wait", 1)]
BACKWARD_2 = [("combine_grad_issue", 1), ("combine_grad_issue", 0),
              ("combine_grad_wait", 1), ("dispatch_grad_issue", 1),
              ("combine_grad_wait", 0), ("dispatch_grad_issue", 0),
              ("dispatch_grad_wait", 1), ("dispatch_grad_wait", 0)]


def _exposed(log: list[tuple[str, int]], compute_starts: str, suffix: str) -> set[tuple[str, int]]:
    """The exchanges (``dispatch``/``combine``, slice) with no other slice's compute starting
    between their issue and their wait."""
    position = {entry: i for i, entry in enumerate(log)}
    exposed = set()
    for (event, index), issued in position.items():
        if not event.endswith(f"_{suffix}issue"):
            continue
        name = event.removesuffix(f"_{suffix}issue")
        waited = position[(f"{name}_{suffix}wait", index)]
        if not any(e == compute_starts and i != index for e, i in log[issued:waited]):
            exposed.add((name, index))
    return exposed


def test_two_slices_overlap_forward_and_backward(two_ranks):
    """Forward: slice 1's dispatch is issued before slice 0's GEMMs and waited after them, and
    slice 0's combine is in flight during slice 1's GEMMs. Backward: slice 0's combine gradient
    is in flight during slice 1's expert backward, and slice 1's dispatch gradient during
    slice 0's."""
    for result in two_ranks:
        assert result["events"][2] == {"forward": FORWARD_2, "backward": BACKWARD_2}


def test_three_slices_hide_all_but_the_first_and_last_exchange(two_ranks):
    for result in two_ranks:
        log = result["events"][3]
        assert _exposed(log["forward"], "experts", "") == {("dispatch", 0), ("combine", 2)}
        assert _exposed(log["backward"], "combine_grad_wait", "grad_") == {("combine", 2), ("dispatch", 0)}
