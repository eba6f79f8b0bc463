"""The upstream module API (``expert_parallelize_modules`` / ``expert_fully_shard_modules``)
called as LLaMA-Factory's ``fsdpturbo`` backend calls it, against the single-process reference.

Tiny Qwen3-MoE (8 experts, top-2), 4 AdamW steps, float32: each step's loss rtol 1e-5, every
first-step gradient (the router's included) rtol 1e-4 / atol 1e-6. Every dispatcher, at
ep 2 x efsdp 2 and ep 4 x efsdp 1 on 4 ranks, and ep 2 x efsdp 1 on 2 ranks (where the
client never calls ``expert_fully_shard_modules``).
"""

import pytest
from distributed_jobs import BATCHES
from ep_api_jobs import api_errors, api_runs, grad_divided_once
from ep_jobs import reference_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}


@pytest.fixture(scope="module")
def reference():
    return run_reference(reference_run, "qwen3_moe", BATCHES, timeout=300)


def test_four_ranks_ep2_efsdp2_and_ep4(reference):
    for results in run_distributed(api_runs, 4, "qwen3_moe", BATCHES, (2, 4), timeout=600):
        runs = [key for key in results if isinstance(key, tuple) and isinstance(key[0], int)]
        assert {key[1] for key in runs} >= {"eager", "fused", "mc2", "default factor"}
        for key in runs:
            assert_parity(reference, results[key], **TOL)
        # the efsdp target was the whole mlp: only its experts shard on the expert mesh,
        # the router stays with the caller's FSDP (its gradient mesh is the caller's dp)
        assert results["experts class"].startswith("FSDP") and not results["mlp class"].startswith("FSDP")
        assert results["router mesh"] == ("dp",)
        # hook modules: the experts gather when their layer starts, before its attention
        plain, hooked = results[("hooks", ())], results[("hooks", ("model.layers.*",))]
        assert plain[1] == [False, False] and hooked[1] == [True, True]
        assert hooked[0].losses == pytest.approx(plain[0].losses, rel=1e-6)


def test_two_ranks_ep2_efsdp1(reference):
    """The efsdp = 1 trap: without expert FSDP the experts' gradients are still divided."""
    for results in run_distributed(api_runs, 2, "qwen3_moe", BATCHES, (2,), timeout=600):
        for key in [k for k in results if isinstance(k, tuple) and isinstance(k[0], int)]:
            assert_parity(reference, results[key], **TOL)
        assert results["experts class"].startswith("EP")


def test_gradient_accumulation_divides_each_micro_batch():
    assert run_distributed(grad_divided_once, 2, 2.0, timeout=300) == [True, True]


def test_bad_calls_fail_on_every_rank_before_a_collective():
    for errors in run_distributed(api_errors, 4, timeout=300):
        assert "ep_mesh=(2, 2) is invalid" in errors["2-D ep mesh"]
        assert "call expert_parallelize_modules" in errors["fully shard first"]
        assert "no expert container is inside" in errors["no expert in target"]
        assert "model.layers.1.mlp.experts" in errors["a container left out"]


def test_facade_takes_the_same_fields(reference):
    """The facade reads the fields the client sets: efsdp targets that hold the router, the
    divide factor (here the dense data-parallel size, the default) and hook modules."""
    from ep_jobs import ep_run

    config = {"expert_parallel_size": 2,
              "ep_plan": {"dispatcher": "fused", "apply_efsdp_modules": ["model.layers.*.mlp"],
                          "gradient_divide_factor": 4.0},
              "fsdp_plan": {"hook_modules": ["model.layers.*"]}}
    for record, facts, experts_class in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, config, timeout=300):
        assert_parity(reference, record, **TOL)
        assert experts_class.startswith("FSDPEP")
        assert facts["model.layers.0.mlp.experts.gate_up_proj"][0] == (2, 64, 64)
