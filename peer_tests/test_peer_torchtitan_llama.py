"""torchtitan's Llama 3 through ``FSDPTurbo(config, model)``, patterns and configuration
only, against the same model trained in one process: float32, 4 AdamW steps, each step's
loss rtol 1e-5, the first step's gradients rtol 1e-4 / atol 1e-6. One 4-rank launch trains
every layout in turn (each from the same seed), each asserted on its own."""

import pytest
from titan_jobs import TITAN_BLOCKS, TITAN_FACTS, TITAN_SP, TITAN_TP, each_layout, reference_run, turbo_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("torchtitan")
# Module-scoped launches: xdist keeps the module on one worker, so each runs once.
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("torchtitan_llama")]

FSDP = {"model_facts": TITAN_FACTS, "fsdp_plan": {"apply_modules": TITAN_BLOCKS}}
LAYOUTS = {
    "fsdp4": {**FSDP, "fully_shard_parallel_size": 4},
    "hsdp 2x2": {**FSDP, "data_parallel_size": 2, "fully_shard_parallel_size": 2},
    "fsdp2 x tp2": {**FSDP, "fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": TITAN_TP},
    "fsdp2 x tp2, sequence parallel": {**FSDP, "fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
                                       "tp_plan": TITAN_SP},
    "fsdp2 x tp2, sequence and loss parallel": {
        **FSDP, "fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
        "tp_plan": {**TITAN_SP, "colwise_parallel": [*TITAN_SP["colwise_parallel"], "output"], "loss_parallel": True}},
    # torchtitan's own units: the embedding, each block, and [norm, output] as one unit that
    # keeps its parameters from forward to backward
    "fsdp4, torchtitan's units": {"fsdp_plan": {"apply_modules": ["tok_embeddings", *TITAN_BLOCKS],
                                                "unit_groups": [["norm", "output"]],
                                                "keep_after_forward": ["output"]},
                                  "fully_shard_parallel_size": 4},
    "fsdp4 + full recompute": {**FSDP, "fully_shard_parallel_size": 4, "recompute": True,
                               "recompute_plan": TITAN_BLOCKS},
    "fsdp4 + selective recompute": {**FSDP, "fully_shard_parallel_size": 4, "recompute": True,
                                    "recompute_plan": TITAN_BLOCKS, "recompute_policy": "selective"},
}


@pytest.fixture(scope="module")
def reference():
    return run_reference(reference_run, timeout=300)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(each_layout, 4, turbo_run, LAYOUTS, timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchtitan_llama_matches_one_process(layout, runs, reference):
    for rank in runs:
        assert_parity(reference, rank[layout], loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
