"""Expert parallel on torchtitan's Qwen3-MoE (its ``GroupedExperts``, a built-in expert form)
through ``FSDPTurbo(config, model)``, patterns and configuration only, against the same model
trained in one process: float32, 4 AdamW steps with torchtitan's load-balancing bias update,
each step's loss rtol 1e-5, the first step's gradients rtol 1e-4 / atol 1e-6, and every step's
global expert counts equal.

Test-side settings, gaps of the CPU build (see ``titan_moe_jobs``): ``use_grouped_mm=False``
(the grouped path calls a Triton permute kernel), ``torch.histc`` on int64 counted in float32
(no CPU kernel), ``init_weights()`` under ``torch.no_grad()``, ``attn_type="sdpa"``.

Every layout runs in one 4-rank launch, one after the other, and each is its own test.
Measured: losses within 8e-8 relative and gradients within 2e-8 of the reference in every
layout; the expert-weight gradients within 5e-11; the counts equal (no routing tie moved).
"""

import pytest
import torch
from titan_moe_jobs import NUM_EXPERTS, TITAN_BLOCKS, TITAN_EXPERTS, reference_run, turbo_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("torchtitan")
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("torchtitan_moe")]

FSDP = {"fsdp_plan": {"apply_modules": TITAN_BLOCKS}, "fully_shard_parallel_size": 4}


def _ep(dispatcher: str, efsdp: int) -> dict:
    return {**FSDP, "expert_parallel_size": 2, "expert_fully_shard_parallel_size": efsdp,
            "ep_plan": {"apply_modules": TITAN_EXPERTS, "dispatcher": dispatcher}}


# name -> (config, experts each rank holds of each container: E / ep / efsdp, or E / fsdp without EP)
LAYOUTS = {
    "fsdp4": (FSDP, NUM_EXPERTS // 4),
    # EP=2, each dispatcher: an EP rank's experts replicated over the other pair (edp 2, efsdp 1).
    "fsdp4, ep2 (edp2), eager": (_ep("eager", 1), NUM_EXPERTS // 2),
    "fsdp4, ep2 (edp2), fused": (_ep("fused", 1), NUM_EXPERTS // 2),
    "fsdp4, ep2 (edp2), mc2": (_ep("mc2", 1), NUM_EXPERTS // 2),
    # Expert FSDP, FSDP=2 x EP=2 on the expert mesh: an EP rank's experts sharded over the other pair.
    "fsdp4, ep2 x efsdp2, fused": (_ep("fused", 2), NUM_EXPERTS // 4),
    # and one replica slot per EP rank, placed at every forward
    "fsdp4, ep2 x efsdp2, fused, redundant experts": (
        {**_ep("fused", 2), "ep_plan": {**_ep("fused", 2)["ep_plan"], "redundant_experts": 1, "rebalance_every": 1}},
        NUM_EXPERTS // 4),
}
_runs = {}


def _results():
    if not _runs:
        _runs["reference"] = run_reference(reference_run, timeout=300)
        configs = {name: config for name, (config, _) in LAYOUTS.items()}
        _runs["ranks"] = run_distributed(turbo_run, 4, configs, timeout=600)
    return _runs["reference"], _runs["ranks"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchtitan_qwen3_moe_matches_one_process(layout):
    (reference, reference_counts), ranks = _results()
    for rank in ranks:
        record, counts, local_experts = rank[layout]
        assert local_experts == LAYOUTS[layout][1]
        assert torch.equal(counts, reference_counts), (counts, reference_counts)
        assert_parity(reference, record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
