"""Expert-parallel pieces in one process: adapters, routing arithmetic, dispatchers at EP=1."""

import copy

import pytest
import torch
from torch import nn

from fsdp_turbo.core.choices import published_choices
from fsdp_turbo.core.testing.models import ExpertMLPList, tiny_hf_causal_lm, to_expert_lists
from fsdp_turbo.distributed.choices import EP_DISPATCHERS
from fsdp_turbo.distributed.expert_parallel import DISPATCHERS, ExpertGroup, expert_adapter, make_expert_parallel
from fsdp_turbo.distributed.expert_parallel.experts import ExpertList, FusedExperts
from fsdp_turbo.distributed.expert_parallel.routing import build_route, count_tokens, fixed_routing, inverse_permutation

pytest.importorskip("transformers")


def test_the_published_dispatcher_names_are_the_dispatchers():
    """The config checks ``ep_plan.dispatcher`` against the published names without importing the
    dispatchers; those names are exactly the dispatchers there are."""
    assert tuple(DISPATCHERS) == EP_DISPATCHERS == published_choices("ep_plan.dispatcher")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_hf_v5_experts_are_recognised_by_form(kind):
    model = tiny_hf_causal_lm(kind)
    found = {n: expert_adapter(m) for n, m in model.named_modules() if n.endswith("mlp.experts")}
    assert found and all(isinstance(a, FusedExperts) and a.num_experts == 8 for a in found.values())
    # Routers, dense MLPs, shared experts and the MoE block itself are not expert containers.
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "shared_experts", "shared_expert", "layers.0.mlp")) or name == "lm_head":
            assert expert_adapter(module) is None, name


def test_module_list_experts_are_recognised():
    holder = to_expert_lists(tiny_hf_causal_lm("qwen3_moe"))
    experts = holder.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertMLPList) and isinstance(expert_adapter(experts), ExpertList)
    # A plain ModuleList (no router-style forward) is not: nothing would call it that way.
    assert expert_adapter(nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])) is None


def test_count_tokens_sorts_by_expert_and_drops_sentinels():
    index = torch.tensor([[3, 0], [8, 3], [1, 0]])
    order, counts = count_tokens(index, num_experts=8)
    assert counts.tolist() == [2, 1, 0, 2, 0, 0, 0, 0]
    assert index.reshape(-1)[order].tolist() == [0, 0, 1, 3, 3]  # the dropped slot (8) is gone


def test_fixed_routing_loads_every_expert_alike():
    """Token t's k-th slot on expert (t * top_k + k) mod E, weight 1/top_k: 37 tokens x top-2 over
    8 experts puts 9 or 10 slots on each, whatever the router chose (here: all on expert 3)."""
    chosen = torch.full((37, 2), 3)
    index, weights = fixed_routing(chosen, torch.rand(37, 2), 8)
    assert index[:2].tolist() == [[0, 1], [2, 3]] and index.dtype == chosen.dtype
    assert sorted(set(torch.bincount(index.reshape(-1), minlength=8).tolist())) == [9, 10]
    assert torch.equal(weights, torch.full((37, 2), 0.5))


def test_build_route_splits_and_expert_major_order():
    # EP=2, 2 local experts. I send 3 rows to rank 0's experts and 2 to rank 1's.
    counts = torch.tensor([1, 2, 0, 2])
    # Rank 0 sends me (rank 1) [e0: 1, e1: 2]; rank 1 (me) sends me [e0: 0, e1: 2].
    received = torch.tensor([[1, 2], [0, 2]])
    route = build_route(torch.arange(5), counts, received, top_k=1)
    assert route.send_splits == [3, 2] and route.recv_splits == [3, 2]
    assert route.recv_expert.tolist() == [0, 1, 1, 1, 1]
    assert route.group_sizes.tolist() == [1, 4]
    assert route.recv_expert[route.expert_major].tolist() == [0, 1, 1, 1, 1]
    perm = torch.tensor([2, 0, 3, 1])
    assert perm[inverse_permutation(perm)].tolist() == [0, 1, 2, 3]


def _routing(tokens=13, hidden=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(tokens)])
    states = torch.randn(tokens, hidden, generator=generator)
    weights = torch.rand(tokens, 2, generator=generator)
    return states, index, weights


@pytest.mark.parametrize("form", ["fused", "list"])
@pytest.mark.parametrize("dispatcher", list(DISPATCHERS))
def test_every_dispatcher_matches_the_unsharded_experts_at_ep1(dispatcher, form):
    model = tiny_hf_causal_lm("qwen3_moe")
    if form == "list":
        model = to_expert_lists(model)
    reference = model.model.layers[0].mlp.experts
    reference.config = copy.copy(getattr(reference, "config", None))
    if form == "fused":
        reference.config._experts_implementation = "eager"
    converted = copy.deepcopy(reference)
    experts = ExpertGroup(expert_adapter(converted), 8, ep_size=1, group=None, num_chunks=3)
    make_expert_parallel(converted, experts, ep_rank=0, dispatcher=dispatcher)
    states, index, weights = _routing()
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in (states, index, weights)]
    others = [t.clone().requires_grad_(t.is_floating_point()) for t in (states, index, weights)]
    expected, got = reference(*inputs), converted(*others)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(others[0].grad, inputs[0].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(others[2].grad, inputs[2].grad, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(reference.named_parameters(), converted.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_npu_kernels_register_only_where_torch_npu_exists():
    import importlib.util
    import sys

    from fsdp_turbo.core.ops import backend_of, registered_ops

    if importlib.util.find_spec("torch_npu") is None:
        assert "npu" not in registered_ops()["ep.mc2"]
        assert backend_of("ep.mc2", "cpu") == "portable"
        assert "torch_npu" not in sys.modules  # importing turbo-distributed never imports it
    else:
        assert backend_of("ep.mc2", "npu") == "npu_mc2"


@pytest.mark.multirank
def test_the_npu_mc2_backend_matches_fused_on_a_torch_npu_stand_in():
    """The NPU backend's glue, run against a stand-in torch_npu with the documented
    dispatch/combine signatures (see npu_standin.py); forward-only, as the kernels are."""
    from npu_standin import mc2_npu_vs_fused

    from fsdp_turbo.core.testing import run_distributed

    for difference in run_distributed(mc2_npu_vs_fused, 2, timeout=120):
        assert difference < 1e-6, difference
