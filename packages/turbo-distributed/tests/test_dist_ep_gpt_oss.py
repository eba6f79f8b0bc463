"""gpt-oss experts under expert parallel: transposed fused weights ``[E, H, 2I]`` / ``[E, I, H]``
with per-expert biases, interleaved gate/up columns and the clamped SwiGLU (the module's own
``_apply_gate`` with its ``alpha`` and ``limit``), behind a biased top-k router.

One process: every dispatcher's computation equals ``GptOssExperts.forward`` (forward and
backward, float32). One 4-rank launch: EP=2 x efsdp=2 with every dispatcher against one
process (losses rtol 1e-5, first-step gradients rtol 1e-4 / atol 1e-6). PEFT LoRA on these
experts is tested where PEFT is installed: integration_tests/test_integ_peft.py.
"""

import copy

import pytest
import torch
from distributed_jobs import BATCHES
from ep_gpt_oss_jobs import gpt_oss_dispatchers_run
from ep_jobs import reference_run

from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.model_inspect import fused_experts_form
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.expert_parallel import DISPATCHERS, ExpertGroup, expert_adapter, make_expert_parallel
from fsdp_turbo.distributed.expert_parallel.experts import FusedExperts

pytest.importorskip("transformers")

TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}
ROWS, HIDDEN, EXPERTS, TOP_K = 48, 64, 8, 2


def test_gpt_oss_experts_are_a_registered_form():
    model = tiny_hf_causal_lm("gpt_oss")
    facts = resolve_model_facts(model)
    assert [e.name for e in facts.experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    adapter = expert_adapter(model.model.layers[0].mlp.experts)
    assert isinstance(adapter, FusedExperts) and adapter.transposed and adapter.num_experts == EXPERTS
    # The router (with its bias) is no expert container: it stays with the dense FSDP.
    assert expert_adapter(model.model.layers[0].mlp.router) is None
    # Without transformers' ``is_transposed`` (its experts decorator adds it; older gpt-oss
    # classes lack it) the shapes say the layout: the two never fit the same shapes.
    experts = model.model.layers[1].mlp.experts
    del experts.is_transposed
    form = fused_experts_form(experts)
    assert form.transposed and form.has_bias and (form.hidden, form.intermediate) == (HIDDEN, 32)


def _routed_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=generator)
    index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(ROWS)])
    weights = torch.rand(ROWS, TOP_K, generator=generator).softmax(-1)
    return x, index, weights


def _forward_backward(experts, x, index, weights, *, keywords: bool = True) -> dict[str, torch.Tensor]:
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    # gpt-oss's own keyword names (transformers' grouped_mm forward takes them positionally only)
    out = experts(x, router_indices=index, routing_weights=weights) if keywords else experts(x, index, weights)
    (out * torch.linspace(-1.0, 1.0, HIDDEN)).sum().backward()
    grads = {f"grad {n}": p.grad for n, p in experts.named_parameters() if p.requires_grad}
    return {"out": out.detach(), "grad x": x.grad, "grad weights": weights.grad, **grads}


def _gpt_oss_experts(alpha: float, limit: float):
    """Layer 0's experts with their own ``alpha`` / ``limit`` (not the config's, so the form
    must read the module's), forward as transformers' loop (its ``eager`` implementation)."""
    experts = tiny_hf_causal_lm("gpt_oss").model.layers[0].mlp.experts
    with torch.no_grad():  # weights large enough that the clamp bites
        experts.gate_up_proj.normal_(0.0, 0.5)
        experts.gate_up_proj_bias.normal_(0.0, 0.5)
    experts.alpha, experts.limit = alpha, limit
    experts.config = copy.deepcopy(experts.config)
    experts.config._experts_implementation = "eager"
    return experts


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
def test_grouped_form_equals_gpt_oss_forward(dispatcher):
    """EP=1 (no communication): each dispatcher (eager loop, or the form's grouped GEMMs)
    against ``GptOssExperts.forward``: output and every gradient, float32, rtol 1e-6."""
    experts = _gpt_oss_experts(alpha=1.3, limit=2.0)
    x, index, weights = _routed_inputs(seed=1)
    with torch.no_grad():
        gate_up = torch.einsum("rh,rkhn->rkn", x, experts.gate_up_proj[index]) + experts.gate_up_proj_bias[index]
    assert (gate_up[..., ::2] > 2.0).any() and (gate_up[..., 1::2].abs() > 2.0).any()  # both clamps active
    expected = _forward_backward(copy.deepcopy(experts), x, index, weights)
    adapter = expert_adapter(experts)
    parallel = make_expert_parallel(copy.deepcopy(experts), ExpertGroup(adapter, EXPERTS, 1, None), 0, dispatcher)
    got = _forward_backward(parallel, x, index, weights)
    assert set(got) == set(expected)
    for name, value in expected.items():
        # Each token's k slots are summed in another order than the loop's index_add_: a
        # rounding of the largest value, hence the scale-relative floor.
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6 * float(value.abs().max()),
                                   msg=lambda m, n=name: f"{dispatcher}, {n}: {m}")


@pytest.mark.multirank
def test_ep2_efsdp2_every_dispatcher_matches_one_process():
    """EP=2 x efsdp=2 on 4 ranks, each dispatcher in one launch, against one process: the
    experts and their biases Shard(0) over EP and over expert FSDP, the router over the
    dense FSDP mesh of all 4 ranks."""
    dispatchers = sorted(DISPATCHERS)
    expected = run_reference(reference_run, "gpt_oss", BATCHES, timeout=300)
    for rank_results in run_distributed(gpt_oss_dispatchers_run, 4, BATCHES, dispatchers, timeout=600):
        assert [d for d, *_ in rank_results] == dispatchers
        for dispatcher, record, placements, experts_class in rank_results:
            assert_parity(expected, record, **TOL)
            assert experts_class.startswith("FSDPEP"), dispatcher
            # 8 experts / ep 2 / efsdp 2: 2 whole experts (and their bias rows) per rank.
            prefix = "model.layers.0.mlp."
            shape, shards, _ = placements[prefix + "experts.gate_up_proj"]
            assert shape == (2, 64, 64) and "Shard(dim=0)" in shards
            assert placements[prefix + "experts.down_proj"][0] == (2, 32, 64)
            shape, shards, _ = placements[prefix + "experts.gate_up_proj_bias"]
            assert shape == (2, 64) and "Shard(dim=0)" in shards
            assert placements[prefix + "experts.down_proj_bias"][0] == (2, 64)
            assert placements[prefix + "router.bias"][2] == 4 and placements[prefix + "router.weight"][2] == 4
