"""One plan per feature, made once: every rank makes the same plans, the facade applies
exactly those, and ``apply`` runs with every resolver disabled (it resolves nothing
again), giving the same training as the facade to the last bit."""

import pytest
import torch
from plan_jobs import plans_and_apply

from fsdp_turbo.core.testing import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

QKV = ["*.q_proj", "*.k_proj", "*.v_proj"]
LAYOUTS = {
    # Every feature but CP: FSDP x TP (SP, loss parallel) x EP, MXFP8 (k/v_proj left out by
    # the TP plan: 16 features per rank), selective recompute, chunked loss, both swaps
    # (forced), per-block compile, prefetch.
    "fsdp2 x tp2 x ep2 + everything": ("qwen3_moe", {"num_hidden_layers": 3}, {
        "fully_shard_parallel_size": 2, "fsdp_plan": {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1},
        "tensor_parallel_size": 2,
        "tp_plan": {"colwise_parallel": [*QKV, "lm_head"], "rowwise_parallel": ["*.o_proj"],
                    "sequence_parallel": ["*layernorm", "model.norm"], "loss_parallel": True},
        "expert_parallel_size": 2, "ep_plan": {"dispatcher": "fused"},
        "quantization_plan": {"quant_format": "E4M3", "block_size": 32},
        "recompute": True, "recompute_plan": ["model.layers.0"], "recompute_policy": "selective",
        "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 12},
        "swap_activation": True, "swap_activation_plan": ["model.layers.{1-2}"], "swap_force": True,
        "swap_optimizer": True,
        "compile": True, "compile_backend": "aot_eager"}),
    "fsdp2 x cp2 + recompute": ("llama", {}, {
        "fully_shard_parallel_size": 2, "context_parallel_size": 2, "recompute": True, "chunk_loss": True}),
    "hsdp 2x2 + ignored + bf16": ("llama", {}, {
        "data_parallel_size": 2, "fsdp_plan": {"param_dtype": "bfloat16", "ignored_modules": ["model.embed_tokens"],
                                               "num_to_backward_prefetch": 2}}),
}
FEATURES = {
    "fsdp2 x tp2 x ep2 + everything": {"quantize", "tensor_parallel", "expert_parallel", "recompute", "chunk_loss",
                                        "swap_activation", "compile", "fully_shard", "swap_optimizer"},
    "fsdp2 x cp2 + recompute": {"context_parallel", "recompute", "chunk_loss", "fully_shard"},
    "hsdp 2x2 + ignored + bf16": {"fully_shard"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plans_are_made_once_and_applied_as_made(layout):
    kind, model_kwargs, config = LAYOUTS[layout]
    results = run_distributed(plans_and_apply, 4, config, kind, model_kwargs, timeout=600)
    for rank, result in enumerate(results):
        assert set(result["plans"]) == FEATURES[layout]
        assert result["plans"] == result["facade_plans"], rank  # the facade applied these plans
        assert all(plans == results[0]["plans"] for plans in result["every_rank"]), rank
        assert result["disabled"] > 20  # the resolvers really were swapped out while applying
        facade, applied = result["facade"], result["planned_then_applied"]
        assert facade.losses == applied.losses, rank
        for name, grad in facade.grads.items():
            torch.testing.assert_close(applied.grads[name], grad, rtol=0, atol=0, msg=name)
