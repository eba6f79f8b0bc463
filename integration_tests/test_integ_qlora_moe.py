"""QLoRA-MX on a MoE model: frozen fused experts (and attention bases) stored, sharded and all-gathered
as MX bytes under expert parallel and FSDP, against one-process PEFT over the same quantized base,
float32: losses rtol 1e-5, adapter gradients rtol 1e-4 / atol 1e-6 (only the adapters train).
"""

import copy

import pytest
import torch
from qlora_moe_jobs import LAYOUTS, facade_runs, reference_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.quantization.frozen import to_mx_frozen_experts
from fsdp_turbo.quantization.training.recipe import MXRecipe

pytest.importorskip("peft")
TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}
# 2 layers x 8 experts x (gate_up 64 x 64 + down 64 x 32), a quarter per rank (EP 2 x efsdp 2, or FSDP 4)
EXPERT_ELEMENTS_PER_RANK = 2 * 8 * (64 * 64 + 64 * 32) // 4


def _frozen_experts_and_adapter():
    from fsdp_turbo.distributed.expert_parallel import expert_adapter

    experts = tiny_hf_causal_lm("qwen3_moe").requires_grad_(False).model.layers[0].mlp.experts
    adapter = expert_adapter(experts)  # planned on the experts as built, as the facade plans before converting
    to_mx_frozen_experts(experts, MXRecipe("E4M3"))
    g = torch.Generator().manual_seed(0)
    routing = (torch.randn(37, 64, generator=g), torch.randint(0, 8, (37, 2), generator=g),
               torch.rand(37, 2, generator=g))
    return experts, adapter, routing


@pytest.mark.parametrize("dispatcher", ["eager", "fused", "mc2", "domino"])
def test_every_dispatcher_runs_frozen_mx_experts_as_their_own_forward_at_ep1(dispatcher):
    """One process: expert parallel reaches the frozen experts' op (the dequantized GEMMs) through
    every dispatcher, and gives their own forward's output and input gradients."""
    from fsdp_turbo.distributed.expert_parallel import ExpertGroup, make_expert_parallel

    experts, adapter, (x, index, weights) = _frozen_experts_and_adapter()
    sharded = make_expert_parallel(copy.deepcopy(experts), ExpertGroup(adapter, 8, 1, None, 3), 0, dispatcher)
    results = []
    for module in (experts, sharded):
        inputs = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(inputs[0], index, inputs[1])
        results.append((out, *torch.autograd.grad(out.square().sum(), inputs)))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_expert_parallel_keeps_whole_packed_experts():
    """EP rank 1 of 2 keeps experts 4..7: their packed bytes as they are, computing what they did."""
    experts, adapter, (x, index, _) = _frozen_experts_and_adapter()
    local = copy.deepcopy(experts)
    adapter.keep_local_experts(local, 4, 4, None)
    for name in ("gate_up_proj", "down_proj"):
        assert getattr(local, name).dtype == torch.uint8
        assert torch.equal(getattr(local, name), getattr(experts, name)[4:])
    rows = (index >= 4).all(1)  # tokens routed to experts 4..7 only
    torch.testing.assert_close(adapter.eager(local, x[rows], index[rows, 0] - 4),
                               adapter.eager(experts, x[rows], index[rows, 0]), rtol=0, atol=0)


@pytest.mark.multirank
def test_qlora_mx_moe_every_dispatcher_at_ep2_x_efsdp2_matches_peft_over_the_same_quantized_base(tmp_path):
    """LoRA on the attention; the attention bases and the experts stored E4M3. Every dispatcher at
    EP=2 x efsdp 2 and plain FSDP=4 in one launch: each rank stores, and the all-gathers move, the
    experts' (1 + 1/32) bytes per element as uint8. A meta-built model loads its base into the same
    packed bytes."""
    tiny_hf_causal_lm("qwen3_moe").save_pretrained(tmp_path / "base")
    reference = run_reference(reference_run, timeout=300)
    assert len(reference.grads) == 2 * 4 * 2  # lora_A and lora_B of 4 attention projections in 2 layers
    for results in run_distributed(facade_runs, 4, str(tmp_path / "base"), timeout=900):
        assert results.pop("meta-built shards that differ") == []
        assert list(results) == list(LAYOUTS)
        for layout, (record, frozen_grads, dtypes, (stored, gathered, span, moved)) in results.items():
            assert_parity(reference, record, **TOL)
            assert frozen_grads == [], layout
            assert dtypes == moved == ["torch.uint8"], layout  # codes and E8M0 scales, interleaved per block
            assert stored == EXPERT_ELEMENTS_PER_RANK * (1 + 1 / 32), layout  # 0.516x of bf16
            assert gathered == stored * span, layout  # the all-gathers move exactly the stored bytes
