"""Expert parallel against the single-process reference on the same global batch, float32.

Tiny HF MoE models (8 experts, top-2), 4 AdamW steps: each step's loss rtol 1e-5, the
first step's full gradients (experts gathered) rtol 1e-4 / atol 1e-6.
"""

import pytest
import torch
from distributed_jobs import BATCHES
from ep_jobs import (
    ROUTES,
    accumulated_reference,
    ep_run,
    ep_runs,
    fixed_router_reference_run,
    merge_rank_grads,
    reference_run,
    router_bias_reference_run,
    uneven_dispatch_runs,
)

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}
_cache = {}


def reference(kind, model_kwargs=None, expert_lists=False):
    key = (kind, repr(model_kwargs), expert_lists)
    if key not in _cache:
        _cache[key] = run_reference(reference_run, kind, BATCHES, model_kwargs, expert_lists, timeout=300)
    return _cache[key]


def ep_config(ep, dispatcher, **extra):
    return {"expert_parallel_size": ep, "ep_plan": {"dispatcher": dispatcher}, **extra}


def redundant(ep, dispatcher, spare, rebalance_every, **extra):
    """``ep_config`` with ``spare`` replica slots per EP rank, placed every ``rebalance_every`` forwards."""
    config = ep_config(ep, dispatcher, **extra)
    config["ep_plan"].update(redundant_experts=spare, rebalance_every=rebalance_every)
    return config


# EP=2 x FSDP=4 (experts shard over efsdp=2 within each EP rank's half): every dispatcher,
# and redundant experts under expert FSDP (a replica's gradient reaches its home expert's
# unsharded weight, which expert FSDP then reduce-scatters).
EP2_FSDP4 = {
    "qwen3_moe": [ep_config(2, "eager"), ep_config(2, "fused"), ep_config(2, "mc2"),
                  redundant(2, "fused", spare=2, rebalance_every=2)],
    "mixtral": [ep_config(2, "eager"), ep_config(2, "fused"), ep_config(2, "mc2"),
                redundant(2, "domino", spare=1, rebalance_every=1)],
}


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_ep2_fsdp4_every_dispatcher(kind):
    """Each config of ``EP2_FSDP4[kind]`` (one launch) against the one-process reference."""
    configs = EP2_FSDP4[kind]
    for results in run_distributed(ep_runs, 4, [(kind, c) for c in configs], BATCHES, timeout=300):
        for config, (record, facts, experts_class, to_replicas) in zip(configs, results, strict=True):
            assert_parity(reference(kind), record, **TOL)
            assert experts_class.startswith("FSDPEP")
            # 8 experts / ep 2 / efsdp 2 = 2 whole experts per rank: Shard(0) on both meshes.
            shape, placements = facts["model.layers.0.mlp.experts.gate_up_proj"]
            assert shape == (2, 64, 64) and "Shard(dim=0)" in placements
            assert (to_replicas > 0) == bool(config["ep_plan"].get("redundant_experts")), config


def test_fixed_router_routes_by_position():
    """``ep_plan.fixed_router`` at EP=2 x FSDP=4: the one-process model with the same routing by
    position (each rank's 32 tokens x top-2 start a whole round of the 8 experts, so position on
    a rank is position in the batch) trains alike; the routers, whose choices are discarded,
    get no gradient (FSDP reduces zeros for them)."""
    expected = run_reference(fixed_router_reference_run, "qwen3_moe", BATCHES, timeout=300)
    config = {"expert_parallel_size": 2, "ep_plan": {"dispatcher": "fused", "fixed_router": True}}
    for record, _, _ in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, config, timeout=300):
        routers = [name for name in record.grads if name.endswith("mlp.gate.weight")]
        assert len(routers) == 2 and all(not record.grads.pop(name).any() for name in routers)
        assert_parity(expected, record, **TOL)
    assert reference("qwen3_moe").losses != expected.losses  # the router's own choices differ


# EP=4 on 4 ranks (2 experts per rank); with redundant experts on every dispatcher, placed
# again at every forward or every other one.
EP4 = [("qwen3_moe", ep_config(4, "fused")), ("mixtral", ep_config(4, "eager")), ("qwen3_moe", ep_config(4, "mc2")),
       ("qwen3_moe", redundant(4, "eager", spare=2, rebalance_every=1)),
       ("qwen3_moe", redundant(4, "fused", spare=1, rebalance_every=2)),
       ("qwen3_moe", redundant(4, "mc2", spare=2, rebalance_every=3)),
       ("mixtral", redundant(4, "domino", spare=3, rebalance_every=1)),
       # placed again at every forward, but not in the recompute, which must route as its forward did
       ("qwen3_moe", redundant(4, "fused", spare=2, rebalance_every=1), "recompute")]


def test_ep4():
    """Each run of ``EP4`` (one launch) against the one-process reference: redundant experts
    train exactly as without them, and their replicas did serve tokens."""
    for results in run_distributed(ep_runs, 4, EP4, BATCHES, timeout=400):
        for (kind, config, *_), (record, facts, _, to_replicas) in zip(EP4, results, strict=True):
            assert_parity(reference(kind), record, **TOL)
            assert facts["model.layers.0.mlp.experts.down_proj"][0] == (2, 64, 32)
            assert (to_replicas > 0) == bool(config["ep_plan"].get("redundant_experts")), config


def test_qwen2_moe():
    """Qwen2-MoE: a shared expert with a gate."""
    for record, _, _ in run_distributed(ep_run, 2, "qwen2_moe", BATCHES, ep_config(2, "fused"), timeout=300):
        assert_parity(reference("qwen2_moe"), record, **TOL)


def test_deepseek_v3_and_its_auxiliary_loss_free_balancing():
    """DeepSeek-V3 (grouped top-k, a dense first layer) at EP=2; then with
    ``router_bias_update_rate``: every rank's router bias moves as the one-process run's does on
    the whole batch (the loads summed over the ranks), so the losses and the biases match."""
    rate = 0.05
    biased_config = ep_config(2, "mc2", router_bias_update_rate=rate)
    # With recompute (transformers' checkpointing), the recomputed router must use the bias its
    # forward used, though the bias has moved since.
    runs = [("deepseek_v3", ep_config(2, "fused")), ("deepseek_v3", biased_config),
            ("deepseek_v3", biased_config, "recompute")]
    biased = run_reference(router_bias_reference_run, "deepseek_v3", BATCHES, rate, timeout=300)
    for plain, *with_bias in run_distributed(ep_runs, 2, runs, BATCHES, timeout=300):
        assert_parity(reference("deepseek_v3"), plain[0], **TOL)
        for record, _, _, _ in with_bias:
            assert_parity(biased, record, **TOL)
            assert record.biases.keys() == biased.biases.keys() and record.biases
            for name, bias in biased.biases.items():
                torch.testing.assert_close(record.biases[name], bias, rtol=0, atol=1e-6)
                assert bias.abs().max() > 0  # it did move
    # and it changed the routing
    assert biased.losses[-1] != pytest.approx(reference("deepseek_v3").losses[-1], rel=1e-4)


def test_hsdp_experts_replicated_over_edp():
    """dp_replicate=2 x fsdp=2, EP=2: edp=2, efsdp=1 (experts replicated, all-reduced)."""
    config = ep_config(2, "fused", data_parallel_size=2, fully_shard_parallel_size=2)
    for record, facts, _ in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, config, timeout=300):
        assert_parity(reference("qwen3_moe"), record, **TOL)
        assert facts["model.layers.0.mlp.experts.gate_up_proj"][0] == (4, 64, 64)


def test_few_experts_shard_dim1():
    """2 experts over EP=2 leave 1 per rank for efsdp=2 ranks: Shard(1)."""
    kwargs = {"num_experts": 2}
    for record, facts, _ in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, ep_config(2, "mc2"), kwargs,
                                            timeout=300):
        assert_parity(reference("qwen3_moe", kwargs), record, **TOL)
        shape, placements = facts["model.layers.0.mlp.experts.gate_up_proj"]
        assert shape == (1, 32, 64) and "Shard(dim=1)" in placements


def test_explicit_prefetch_across_ep_layers():
    config = ep_config(2, "fused", fsdp_plan={"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1})
    for record, _, _ in run_distributed(ep_run, 4, "mixtral", BATCHES, config, timeout=300):
        assert_parity(reference("mixtral"), record, **TOL)


def test_router_aux_loss_matches_data_parallel_reference():
    """output_router_logits: each data shard's auxiliary loss, averaged, as plain DP computes it."""
    kwargs = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
    expected = run_reference(accumulated_reference, "qwen3_moe", BATCHES, 4, kwargs, timeout=300)
    for record, _, _ in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, ep_config(2, "fused"), kwargs,
                                        timeout=300):
        assert_parity(expected, record, **TOL)
    # The auxiliary loss is really in there.
    assert expected.losses[0] != pytest.approx(reference("qwen3_moe").losses[0], rel=1e-4)


def test_module_list_experts():
    """A custom model's ModuleList of expert MLPs: each rank keeps its experts under their
    global names; gradients compared after merging every rank's experts."""
    results = run_distributed(ep_run, 4, "qwen3_moe", BATCHES, ep_config(2, "fused"), None, True, timeout=300)
    expected = reference("qwen3_moe", None, True)
    merged = merge_rank_grads([record for record, _, _ in results])
    assert set(merged) == set(expected.grads)
    for name, grad in expected.grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for record, facts, _ in results:
        torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(expected.losses), rtol=1e-5, atol=0)
        # Rank-local experts keep their global index: EP rank 0 holds 0-3, EP rank 1 holds 4-7.
        owned = {int(n.split(".")[5]) for n in facts if n.startswith("model.layers.0.")}
        assert owned in ({0, 1, 2, 3}, {4, 5, 6, 7})


UNEVEN = [(dispatcher, form, spare) for spare in (0, 2) for form in ("fused", "list")
          for dispatcher in ("eager", "fused", "mc2")]


def test_uneven_routing_with_idle_experts():
    """Hand-made routing: rank 0 sends nothing to rank 1, one slot is dropped, five experts
    get no token anywhere. Output, input/weight gradients and expert gradients match, for every
    dispatcher and both forms, without and with 2 replica slots per rank (expert 0, which takes
    most slots, is then copied to rank 1; a ModuleList's replicas run on the replica's weights)."""
    assert sum(len(r) for r in ROUTES.values()) == 11
    for results in run_distributed(uneven_dispatch_runs, 2, UNEVEN, timeout=300):
        for (dispatcher, form, spare), result in zip(UNEVEN, results, strict=True):
            case = f"{dispatcher}, {form}, {spare} replica slots"
            for got, expected in zip(result["got"], result["expected"], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, c=case: f"{c}: {m}")
            # Fused weights gather through full_tensor(); a ModuleList rank has its own experts only.
            assert len(result["local_grads"]) == (2 if form == "fused" else 4 * 3)
            for name, grad in result["local_grads"].items():
                torch.testing.assert_close(grad, result["reference_grads"][name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, c=case: f"{c}, {n}: {m}")
            assert (result["to_replicas"] > 0) == bool(spare), case


def test_dcp_checkpoint_round_trip(tmp_path):
    """Expert weights are DTensors with the global shape: DCP saves each expert once and a
    fresh EP model loads them back (the same evaluation losses afterwards). A model trained with
    redundant experts saves only its experts (replicas are fetched, not kept), so it resumes at
    another layout: EP=4 without replicas."""
    from ep_jobs import both_round_trips_run

    results = run_distributed(both_round_trips_run, 4, "qwen3_moe", BATCHES, ep_config(2, "fused"),
                              redundant(2, "mc2", spare=2, rebalance_every=1), ep_config(4, "fused"),
                              str(tmp_path), timeout=300)
    for (expected, got, full), (other_expected, other_got, other_full) in results:
        assert got == expected
        assert full["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
        torch.testing.assert_close(torch.tensor(other_got), torch.tensor(other_expected), rtol=1e-5, atol=0)
        assert set(other_full) == set(full)
