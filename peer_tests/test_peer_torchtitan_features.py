"""torchtitan's Llama 3 through ``FSDPTurbo(config, model)`` with the remaining dense
features, patterns and configuration only, against one process: float32 master weights,
4 AdamW steps, each step's loss and the first step's gradients.

One 4-rank launch trains every 4-rank layout in turn (each from the same seed, each
asserted on its own below), one process makes every reference, and the 8-rank row has its
own launch: three starts for the file. Measured on 2 shared cores: the reference process
and the 4-rank launch 36 s with a warm inductor cache, 50 s cold (compile is most of the
difference); the 8-rank launch 25-42 s; the file 70-90 s.

Tolerances, unless a test states otherwise: loss rtol 1e-5, gradients rtol 1e-4 / atol 1e-6.
"""

import pytest
import torch
from titan_feature_jobs import MX_PLAN, TITAN_LINEARS, layouts_run, references
from titan_jobs import TITAN_BLOCKS, TITAN_FACTS, TITAN_SP, titan_llama

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.parity import sqnr_db

pytest.importorskip("torchtitan")
# Module-scoped launches: xdist keeps the module on one worker, so each runs once.
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("torchtitan_features")]

FSDP4 = {"model_facts": TITAN_FACTS, "fsdp_plan": {"apply_modules": TITAN_BLOCKS}, "fully_shard_parallel_size": 4}
# HSDP 2 x 2: four data shards of one row each.
MIXED = {"model_facts": TITAN_FACTS, "data_parallel_size": 2, "fully_shard_parallel_size": 2,
         "fsdp_plan": {"apply_modules": TITAN_BLOCKS, "param_dtype": "bfloat16", "reduce_dtype": "float32",
                       "num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}}
DATA_SHARDS = 4
LAYOUTS = {
    "hsdp 2x2, bf16 params / fp32 reduce, prefetch": MIXED,
    # Both blocks swapped (the default: torchtitan's ModuleDict of layers); the first one's
    # activations leave when the second starts, the last stays resident. Forced on CPU.
    "fsdp4 + activation swap": {**FSDP4, "swap_activation": True, "swap_force": True},
    "fsdp4 + optimizer swap": {**FSDP4, "swap_optimizer": True, "swap_force": True},
    "fsdp4 + mxfp8": {**FSDP4, "quantization_plan": MX_PLAN},
    "fsdp4": FSDP4,
    # inductor, as the compile integration tests: one graph for both blocks.
    "fsdp4 + compiled blocks": {**FSDP4, "compile": True},
}


@pytest.fixture(scope="module")
def reference():
    return run_reference(references, DATA_SHARDS, timeout=300)


@pytest.fixture(scope="module")
def runs():
    """Each rank's ``{layout: (record, facts)}``."""
    return run_distributed(layouts_run, 4, LAYOUTS, timeout=900)


def _each(runs, layout):
    return [rank[layout] for rank in runs]


def test_mixed_precision_hsdp_matches_the_same_policy_in_one_process(runs, reference):
    """bf16 compute, fp32 reduction and fp32 master weights, against one process applying the
    same policy honestly (each data shard's forward and backward with bf16 parameters, the
    gradients cast to fp32 and averaged in fp32; ``mixed_precision_reference_run``). The
    per-shard computations are the same, so the standard tolerances hold (measured: losses
    equal to the last bit, gradients within 5e-9 relative). That bf16 is really in use: the
    fp32 model is measured 4e-4 relative away in loss and at 40 dB gradient SQNR, held to
    more than rtol 1e-5 and less than 60 dB."""
    fp32, policy = reference["fp32"], reference["bf16"]
    for record, facts in _each(runs, "hsdp 2x2, bf16 params / fp32 reduce, prefetch"):
        assert facts["master_dtypes"] == ["torch.float32"]
        assert_parity(policy, record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(record.losses, fp32.losses, strict=True))
        assert loss_gap > 1e-5, (record.losses, fp32.losses)
        assert min(sqnr_db(fp32.grads[n], g) for n, g in record.grads.items()) < 60


@pytest.mark.parametrize("layout, fact", [("fsdp4 + activation swap", "activations_swapped_out"),
                                          ("fsdp4 + optimizer swap", "optimizer_swap_ins")])
def test_swaps_match_one_process(runs, reference, layout, fact):
    """Measured: losses within 1e-7 relative, gradients within 5e-7 of the largest."""
    for record, facts in _each(runs, layout):
        assert facts[fact] > 0  # the swap really moved something
        assert_parity(reference["fp32"], record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


def test_mxfp8_matches_the_emulated_mx_model(runs, reference):
    """MXFP8 (E4M3, blocks of 32) on the blocks' Linears, picked by torchtitan's names (the
    output head stays high precision), against the one-process emulated-MX model.

    Forward and dgrad quantize along K (per token), and each rank's 32-token row is exactly
    one wgrad block along the tokens in one process too; the per-rank loss's 1/4 larger
    mean is a power of two, so the MX scales shift exactly. Only fp32 summation orders
    differ (measured: losses within 1e-7 relative, every gradient above 134 dB SQNR). A
    last-bit difference that crosses an FP8 rounding boundary moves one element by a whole
    FP8 step, which the bounds leave room for. Stated: first loss rtol 1e-5, every loss rtol
    1e-4, every first-step gradient at least 60 dB SQNR. MX is really in use: the fp32 model
    is more than rtol 1e-5 away."""
    from fsdp_turbo.core.model_facts import ModelFactsConfig, resolve_model_facts
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.converter import plan_conversion

    # The default plan picks the same modules once the model facts name the head (torchtitan's
    # has no get_output_embeddings()).
    model = titan_llama()
    titan_facts = resolve_model_facts(model, ModelFactsConfig(**TITAN_FACTS))
    by_default, _ = plan_conversion(model, QuantizeConfig(), titan_facts)
    assert {c.name for c in by_default} == {n for n, k in _each(runs, "fsdp4 + mxfp8")[0][1]["modules"].items()
                                           if k == "MXLinear"}
    mx, fp32 = reference["mx"], reference["fp32"]
    assert max(abs(a - b) / abs(b) for a, b in zip(mx.losses, fp32.losses, strict=True)) > 1e-5
    for record, facts in _each(runs, "fsdp4 + mxfp8"):
        converted = {name for name, kind in facts["modules"].items() if kind == "MXLinear"}
        assert len(converted) == len(TITAN_LINEARS) * 2 and facts["modules"]["output"] == "Linear"
        torch.testing.assert_close(record.losses[0], mx.losses[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(mx.losses), rtol=1e-4, atol=0)
        assert record.grads.keys() == mx.grads.keys()
        for name, grad in record.grads.items():
            assert sqnr_db(mx.grads[name], grad) >= 60, name


def test_compiled_blocks_match_eager(runs, reference):
    """Each block's forward compiled (inductor) under FSDP=4, against the same layout eager in
    the same ranks, and that eager layout against one process. torchtitan's complex
    rotary embedding traces: no graph break, one graph serves both blocks. Measured:
    losses within 2e-8 relative, gradients within 3e-7 of the largest."""
    for (eager, _), (compiled, facts) in zip(_each(runs, "fsdp4"), _each(runs, "fsdp4 + compiled blocks"),
                                             strict=True):
        assert facts["graph_breaks"] == 0, facts["graph_break_reasons"]
        assert facts["graphs"] == 1
        assert_parity(reference["fp32"], eager, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
        assert_parity(eager, compiled, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


# 2 replicas x 2 shards x TP 2, sequence parallel and the loss-parallel head: four data shards.
DP_FSDP_TP = {"model_facts": TITAN_FACTS,
              "data_parallel_size": 2, "fully_shard_parallel_size": 2, "fsdp_plan": {"apply_modules": TITAN_BLOCKS},
              "tensor_parallel_size": 2,
              "tp_plan": {**TITAN_SP, "colwise_parallel": [*TITAN_SP["colwise_parallel"], "output"],
                          "loss_parallel": True}}


@pytest.mark.eight_ranks
@pytest.mark.timeout(240)
def test_dp2_x_fsdp2_x_tp2_matches_one_process(reference):
    """The 8-rank row. Measured: losses within 6e-8 relative, gradients within 5e-7 of the largest."""
    for rank in run_distributed(layouts_run, 8, {"dp2 x fsdp2 x tp2": DP_FSDP_TP}, timeout=600):
        record, _ = rank["dp2 x fsdp2 x tp2"]
        assert_parity(reference["fp32"], record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
