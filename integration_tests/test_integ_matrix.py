"""The composition matrix (issue 9, first rows): 5-D layouts through the facade against the
single-process reference, float32. 4 AdamW steps; each step's loss rtol 1e-5, the first
step's full gradients rtol 1e-4 / atol 1e-6. The 8-rank rows take about 10 s each here."""

import pytest
from composed_jobs import FSDP_TP, QKV, matrix_reference_run, matrix_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TP_PLAN = {"colwise_parallel": [*QKV, "*.gate_proj", "*.up_proj"], "rowwise_parallel": ["*.o_proj", "*.down_proj"]}
LAYOUTS = {
    # 8 ranks: 2 replicas x 2 shards x TP 2, with sequence parallel and the loss-parallel head.
    "dp2 x fsdp2 x tp2": ("llama", 8, {**FSDP_TP, "data_parallel_size": 2}),
    # 8 ranks: Ulysses over 2 ranks inside each TP pair's heads (4 heads = tp x cp).
    "fsdp2 x cp2 x tp2": ("llama", 8, {"fully_shard_parallel_size": 2, "context_parallel_size": 2,
                                       "tensor_parallel_size": 2, "tp_plan": TP_PLAN}),
    # 4 ranks: MoE layers route each CP chunk's tokens to their experts over EP.
    "fsdp2 x cp2 x ep2": ("qwen3_moe", 4, {"fully_shard_parallel_size": 2, "context_parallel_size": 2,
                                           "expert_parallel_size": 2, "ep_plan": {"dispatcher": "fused"}}),
}
_references = {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_composition_matrix(layout):
    kind, world, config = LAYOUTS[layout]
    if kind not in _references:
        _references[kind] = run_reference(matrix_reference_run, kind, timeout=300)
    for record in run_distributed(matrix_run, world, kind, config, timeout=600):
        assert_parity(_references[kind], record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
