"""torchtitan's Llama 3 under context parallel (Ulysses, ring, hybrid) by naming its
attention modules and forward arguments, and under chunked loss by naming its head; its
loss computed by ``lm_loss`` (the model returns logits), against the same model trained in one process with a plain
cross-entropy: float32, 4 AdamW steps, losses rtol 1e-5, first-step gradients rtol 1e-4 /
atol 1e-6. One 4-rank launch trains every layout in turn, each asserted on its own."""

import pytest
from titan_jobs import TITAN_BLOCKS, TITAN_FACTS, TITAN_SP, VOCAB, each_layout, reference_run
from titan_loss_jobs import turbo_lm_loss_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("torchtitan")
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("torchtitan_cp")]

FSDP = {"model_facts": TITAN_FACTS, "fsdp_plan": {"apply_modules": TITAN_BLOCKS}}
LAYOUTS = {
    "ulysses cp2 x fsdp2": {**FSDP, "fully_shard_parallel_size": 2, "context_parallel_size": 2, "cp_plan": {}},
    "ring cp2 x fsdp2": {**FSDP, "fully_shard_parallel_size": 2, "context_parallel_size": 2,
                         "cp_plan": {"mode": "ring"}},
    "hybrid 2x2": {**FSDP, "context_parallel_size": 4, "cp_plan": {"mode": "hybrid", "ulysses_size": 2}},
    "cp2 x tp2, sequence and loss parallel": {
        **FSDP, "context_parallel_size": 2, "tensor_parallel_size": 2, "cp_plan": {},
        "tp_plan": {**TITAN_SP, "colwise_parallel": [*TITAN_SP["colwise_parallel"], "output"], "loss_parallel": True}},
    "fsdp4, chunked loss": {**FSDP, "fully_shard_parallel_size": 4, "chunk_loss": True,
                            "chunk_loss_plan": {"chunk_size": 24}},
    "ring cp2 x fsdp2, chunked loss": {**FSDP, "fully_shard_parallel_size": 2, "context_parallel_size": 2,
                                       "cp_plan": {"mode": "ring"}, "chunk_loss": True,
                                       "chunk_loss_plan": {"chunk_size": 24}},
}
@pytest.fixture(scope="module")
def reference():
    return run_reference(reference_run, timeout=300)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(each_layout, 4, turbo_lm_loss_run, LAYOUTS, timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchtitan_llama_context_parallel_matches_one_process(layout, runs, reference):
    config = LAYOUTS[layout]
    for rank in runs:
        record, widths = rank[layout]
        assert_parity(reference, record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
        # chunked: the head never built logits; otherwise every call built this rank's share
        assert set(widths) == ({0} if config.get("chunk_loss") else {VOCAB // (2 if "tp_plan" in config else 1)})
